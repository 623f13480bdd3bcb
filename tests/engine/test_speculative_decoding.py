"""Speculative decoding (n-gram prompt lookup): greedy tokens are HF's, token for token,
through chunked prefill, preemption, prefix hits, stops inside an accepted draft and async
scheduling; logprobs are the unspeculated engine's; seeded sampling repeats itself; requests
that cannot speculate run as without it."""

import pytest

from octavo.engine import EngineConfig, LLMEngine, SamplingParams
from tests.checkpoints import sample_prompts
from tests.engine.helpers import hf_greedy, run_to_completion

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(hf_tiny):
    """Prompts that quote themselves (a passage, then its first half again), as documents
    asked about do: there is something to look up."""
    passages = sample_prompts(12, 8, 80, hf_tiny.config.vocab_size, seed=3)
    return [p + p[: len(p) // 2] for p in passages]


@pytest.fixture(scope="module")
def expected(hf_tiny, prompts):
    return [hf_greedy(hf_tiny, p, MAX_TOKENS) for p in prompts]


def engine_for(model_dir, speculative: dict | None = NGRAM, **overrides) -> LLMEngine:
    config = {
        "model": model_dir, "device": "cpu", "dtype": "float32", "num_blocks": 512,
        "block_size": 16, "async_scheduling": False, "speculative_config": speculative,
    } | overrides  # fmt: skip
    return LLMEngine(EngineConfig(**config))


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"async_scheduling": True},  # speculating requests run their steps in order
        {"max_num_batched_tokens": 8, "block_size": 4},  # chunked prefill; drafts cut
        # Preemption by recompute: the longest request (about 150 tokens, 19 blocks) fits
        # alone, all 12 do not.
        {"num_blocks": 34, "block_size": 8, "max_model_len": 192},
    ],
    ids=["plain", "async_scheduling", "chunked_prefill", "preemption"],
)
def test_greedy_tokens_are_hfs_and_drafts_are_accepted(
    tiny_model_dir, prompts, expected, overrides
):
    engine = engine_for(tiny_model_dir, **overrides)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    assert tokens_of(run_to_completion(engine, prompts, params)) == expected
    stats = engine.stats()
    # Speculation really ran and saved steps: some drafts were accepted, not all.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # By position: a draft token is kept only after every one before it.
    per_pos = stats.num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
    assert stats.num_generation_tokens == sum(len(e) for e in expected)
    if "num_blocks" in overrides:
        assert stats.num_preemptions > 0


def test_prefix_hits_and_a_second_round_keep_the_tokens(tiny_model_dir, prompts, expected):
    engine = engine_for(tiny_model_dir)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    run_to_completion(engine, prompts, params)
    again = run_to_completion(engine, prompts, params)
    assert engine.stats().num_prefix_cache_hits > 0
    assert tokens_of(again) == expected


def test_a_stop_inside_an_accepted_draft_ends_the_sequence_there(eos_model_dir, hf_eos):
    """EOS and max_tokens fall inside runs of accepted draft tokens: nothing past them is
    kept or counted."""
    passages = sample_prompts(12, 8, 60, hf_eos.config.vocab_size, seed=5)
    prompts = [p + p[: len(p) // 2] for p in passages]
    lengths = [3 + i % 7 for i in range(len(prompts))]
    engine = engine_for(eos_model_dir)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in lengths]
    outputs = run_to_completion(engine, prompts, params)
    for prompt, n, output in zip(prompts, lengths, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_eos, prompt, n)
    assert {o.outputs[0].finish_reason for o in outputs} == {"stop", "length"}
    assert engine.stats().num_generation_tokens == sum(len(t) for t in tokens_of(outputs))


def test_logprobs_are_the_unspeculated_engines(tiny_model_dir, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3)
    plain = run_to_completion(engine_for(tiny_model_dir, None), prompts, params)
    speculated = run_to_completion(engine_for(tiny_model_dir), prompts, params)
    for a, b in zip(plain, speculated, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob)
        for top_a, top_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert top_a.keys() == top_b.keys()
            for token in top_a:
                assert top_b[token] == pytest.approx(top_a[token], abs=1e-5)


def test_requests_that_cannot_speculate_run_as_without_it(tiny_model_dir, prompts):
    """min_tokens and penalties: the same tokens as an engine without speculation, and no
    draft verified for them."""
    params = [
        SamplingParams(temperature=0.8, seed=7, n=2, min_tokens=4, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0, presence_penalty=0.5, max_tokens=MAX_TOKENS),
    ] * 3
    chosen = prompts[: len(params)]
    plain = run_to_completion(engine_for(tiny_model_dir, None), chosen, params)
    engine = engine_for(tiny_model_dir)
    speculated = run_to_completion(engine, chosen, params)
    for a, b in zip(plain, speculated, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert engine.stats().num_draft_tokens == 0


def test_seeded_sampling_speculates_and_repeats_itself(tiny_model_dir, prompts):
    """A sampled request speculates (its distribution is kept: test_speculative_sampling.py)
    and, seeded, gives the same tokens run after run."""
    params = [SamplingParams(temperature=0.3, seed=i, max_tokens=MAX_TOKENS) for i in range(12)]
    runs = []
    for _ in range(2):
        engine = engine_for(tiny_model_dir)
        runs.append(tokens_of(run_to_completion(engine, prompts, params)))
        assert engine.stats().num_draft_tokens > 0
    assert runs[0] == runs[1]


def test_no_draft_above_disable_by_batch_size(tiny_model_dir, prompts, expected):
    """Requests of staggered lengths: the batch shrinks as they end, and only the last ones,
    running 4 or fewer at a time, speculate."""
    lengths = [4 + 2 * i for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in lengths]
    limited = engine_for(tiny_model_dir, NGRAM | {"disable_by_batch_size": 4})
    outputs = run_to_completion(limited, prompts, params)
    assert tokens_of(outputs) == [e[:n] for e, n in zip(expected, lengths, strict=True)]
    always = engine_for(tiny_model_dir)
    run_to_completion(always, prompts, params)
    assert 0 < limited.stats().num_draft_tokens < always.stats().num_draft_tokens


def test_several_samples_speculate_each(tiny_model_dir, prompts, expected):
    """n = 3 greedy samples are each HF's tokens; seeded n = 2 and best_of = 3 samples
    speculate and repeat themselves."""
    engine = engine_for(tiny_model_dir)
    greedy = run_to_completion(
        engine, prompts, SamplingParams(temperature=0, n=3, max_tokens=MAX_TOKENS)
    )
    for output, tokens in zip(greedy, expected, strict=True):
        assert [o.token_ids for o in output.outputs] == [tokens] * 3
    assert engine.stats().num_accepted_tokens > 0
    params = [
        SamplingParams(temperature=0.3, seed=i, n=2, best_of=3 if i % 2 else None,
                       max_tokens=MAX_TOKENS)
        for i in range(len(prompts))
    ]  # fmt: skip
    runs = []
    for _ in range(2):
        engine = engine_for(tiny_model_dir)
        outputs = run_to_completion(engine, prompts, params)
        runs.append([[o.token_ids for o in output.outputs] for output in outputs])
        assert engine.stats().num_draft_tokens > 0
    assert runs[0] == runs[1]
    assert all(len(samples) == 2 for samples in runs[0])
