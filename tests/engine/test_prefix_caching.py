"""Prefix caching changes no output: greedy and beam search against Hugging Face, seeded
sampling and prompt logprobs against the engine without caching, over workloads that share
prefixes heavily, with chunked prefill, preemption and one-step-ahead scheduling; and it
does hit."""

import pytest
import torch

from octavo.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from octavo.engine.sampling_params import BeamSearchParams
from tests.engine.helpers import hf_greedy
from tests.engine.test_beam_search import hf_beam_search

MAX_TOKENS = 16


def shared_prefix_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts built to hit: a 70-token system prefix with suffixes of many lengths, exact
    repeats, a prompt that is a prefix of others, block-aligned lengths (32, 64), and two
    families of prompts that share a shorter prefix."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, vocab_size, (n,), generator=generator).tolist()

    system, other = tokens(70), tokens(21)
    prompts = [system + tokens(n) for n in (1, 5, 9, 16, 30)]
    prompts += [prompts[1], prompts[3], system, system[:64], system[:32]]
    prompts += [other + tokens(n) for n in (3, 11, 40)] + [tokens(45)]
    return prompts


def run_in_waves(
    engine: LLMEngine, waves: list[list[list[int]]], params: SamplingParams | BeamSearchParams
) -> list[RequestOutput]:
    """Each wave is added at once and run to completion before the next (which then finds
    the first waves' blocks evictable); the BlockManager's invariants hold after every step
    and every block is free or cached at the end."""
    finished: dict[str, RequestOutput] = {}
    ids = []
    for w, wave in enumerate(waves):
        for i, prompt in enumerate(wave):
            ids.append(f"w{w}-{i}")
            engine.add_request(ids[-1], prompt, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
            engine.block_manager.check_invariants()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    return [finished[i] for i in ids]


def engine_for(model_dir: str, **overrides) -> LLMEngine:
    config = {"model": model_dir, "device": "cpu", "dtype": "float32"} | overrides
    return LLMEngine(EngineConfig(**config))


@pytest.fixture(scope="module")
def prompts(hf_eos):
    return shared_prefix_prompts(hf_eos.config.vocab_size, seed=3)


@pytest.fixture(scope="module")
def expected(hf_eos, prompts):
    return [hf_greedy(hf_eos, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize(
    "overrides",
    [
        roomy := {"num_blocks": 512, "block_size": 16},
        roomy | {"async_scheduling": True},
        chunked := {"num_blocks": 2048, "block_size": 4, "max_num_batched_tokens": 37},
        chunked | {"async_scheduling": True},
        # Preemption: 17 blocks of 8 tokens hold the longest request (116 tokens) and little
        # else, shared blocks included.
        preempting := {
            "num_blocks": 18,
            "block_size": 8,
            "max_num_batched_tokens": 96,
            "max_model_len": 128,
        },
        preempting | {"async_scheduling": True},
    ],
    ids=["roomy", "roomy_async", "chunked", "chunked_async", "preempting", "preempting_async"],
)
def test_greedy_with_caching_equals_hf(eos_model_dir, prompts, expected, overrides):
    engine = engine_for(eos_model_dir, **overrides)
    half = len(prompts) // 2
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = run_in_waves(engine, [prompts[:half], prompts[half:]], greedy)
    for i, (output, want) in enumerate(zip(outputs, expected, strict=True)):
        assert output.outputs[0].token_ids == want, f"prompt {i}"
    stats = engine.stats()
    assert stats.num_prefix_cache_hits > 0.3 * stats.num_prefix_cache_queries
    if overrides["num_blocks"] < 100:
        assert stats.num_preemptions > 0
    # The oracle exercises something: stops on EOS and runs to the length limit.
    reasons = {o.outputs[0].finish_reason for o in outputs}
    assert reasons == {"stop", "length"}


def test_beam_search_with_caching_equals_hf(eos_model_dir, hf_eos, prompts):
    params = BeamSearchParams(beam_width=3, max_tokens=10, num_return_sequences=2)
    engine = engine_for(eos_model_dir, num_blocks=600, block_size=4, max_num_batched_tokens=128)
    chosen = prompts[:3] + prompts[5:8]
    outputs = run_in_waves(engine, [chosen[:3], chosen[3:]], params)
    for prompt, output in zip(chosen, outputs, strict=True):
        sequences, scores = hf_beam_search(hf_eos, prompt, params)
        assert [o.token_ids for o in output.outputs] == sequences
        for ours, theirs in zip((o.score for o in output.outputs), scores, strict=True):
            assert ours == pytest.approx(theirs, abs=1e-4)
    assert engine.stats().num_prefix_cache_hits > 0


def test_seeded_sampling_and_parallel_samples_are_unchanged(eos_model_dir, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS, n=3, seed=11)
    waves = [prompts[:6], prompts[6:]]
    results = {}
    for caching in (False, True):
        engine = engine_for(
            eos_model_dir, num_blocks=400, block_size=8, enable_prefix_caching=caching
        )
        outputs = run_in_waves(engine, waves, params)
        results[caching] = [[c.token_ids for c in o.outputs] for o in outputs]
        assert (engine.stats().num_prefix_cache_hits > 0) == caching
    assert results[True] == results[False]


def test_prompt_logprobs_are_computed_never_taken_from_the_cache(eos_model_dir, prompts):
    """A request that scores its prompt computes all of it (cached positions have no logits)
    and gets the values the engine without caching gives."""
    scoring = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    results = {}
    for caching in (False, True):
        engine = engine_for(
            eos_model_dir, num_blocks=400, block_size=8, enable_prefix_caching=caching
        )
        warm = run_in_waves(engine, [prompts[:5]], SamplingParams(temperature=0, max_tokens=2))
        assert len(warm) == 5
        [output] = run_in_waves(engine, [[prompts[2]]], scoring)
        results[caching] = output.prompt_logprobs
    assert results[True] is not None and len(results[True]) == len(prompts[2])
    for ours, reference in zip(results[True], results[False], strict=True):
        assert (ours is None) == (reference is None)
        if ours is not None:
            assert ours.keys() == reference.keys()
            assert list(ours.values()) == pytest.approx(list(reference.values()), abs=1e-5)


def test_a_request_reports_its_cached_prompt_tokens(eos_model_dir, prompts):
    engine = engine_for(eos_model_dir, num_blocks=400, block_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=3)
    [first] = run_in_waves(engine, [[prompts[0]]], greedy)
    [again] = run_in_waves(engine, [[prompts[0]]], greedy)
    [longer] = run_in_waves(engine, [[prompts[4]]], greedy)
    assert first.num_cached_tokens == 0
    # 71 tokens: 8 full blocks, of which the last token's must be computed: 8 * 8 = 64.
    assert again.num_cached_tokens == 64
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert longer.num_cached_tokens == 64  # the 70-token system prefix, in full blocks
    off = engine_for(eos_model_dir, num_blocks=400, block_size=8, enable_prefix_caching=False)
    [cold] = run_in_waves(off, [[prompts[0]], [prompts[0]]], greedy)[1:]
    assert cold.num_cached_tokens == 0


def test_aborts_mid_prefill_and_mid_decode_leave_every_block_free_or_cached(
    eos_model_dir, prompts, expected
):
    """Requests that share blocks are aborted while prefilling and while decoding; the
    others finish as HF says, and nothing leaks."""
    engine = engine_for(eos_model_dir, num_blocks=300, block_size=4, max_num_batched_tokens=24)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for i, prompt in enumerate(prompts[:6]):
        engine.add_request(f"r{i}", prompt, greedy)
    finished: dict[str, RequestOutput] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step == 2:
            aborted = engine.abort_request("r1")  # still prefilling (24 tokens a step)
            assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
        if step == 30:
            engine.abort_request("r3")  # decoding, or finished already
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.block_manager.check_invariants()
        step += 1
    for i in (0, 2, 4, 5):
        assert finished[f"r{i}"].outputs[0].token_ids == expected[i], f"prompt {i}"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks and bm.num_cached_blocks > 0
    assert engine.stats().num_prefix_cache_hits > 0
