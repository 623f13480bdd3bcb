"""logit_bias, allowed_token_ids, bad_words and truncate_prompt_tokens in the engine, against
Hugging Face generate with its equivalent logits processors (greedy, token for token)."""

import pytest
import torch

from octavo.engine import EngineConfig, LLMEngine, SamplingParams
from octavo.engine.errors import ParameterError
from tests.checkpoints import sample_prompts
from tests.engine.helpers import hf_greedy, run_to_completion

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", num_blocks=512)
    )


@pytest.fixture(scope="module")
def prompts(hf_tiny):
    return sample_prompts(6, 4, 40, hf_tiny.config.vocab_size, seed=7)


def hf_generate(hf_model, prompt: list[int], **processors) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
            pad_token_id=hf_model.config.eos_token_id, **processors,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def generate(engine, prompts, **controls) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **controls)
    return [o.outputs[0].token_ids for o in run_to_completion(engine, prompts, params)]


def test_logit_bias_equals_hf_sequence_bias(engine, hf_tiny, prompts):
    plain = [hf_greedy(hf_tiny, p, MAX_TOKENS) for p in prompts]
    # Push up a token the model rarely picks, push down the one it picks most.
    counts = torch.bincount(torch.tensor([t for g in plain for t in g]))
    favourite = int(counts.argmax())
    bias = {favourite: -100.0, 7: 6.0}
    got = generate(engine, prompts, logit_bias=bias)
    want = [
        hf_generate(hf_tiny, p, sequence_bias={(t,): b for t, b in bias.items()}) for p in prompts
    ]
    assert got == want
    assert all(favourite not in g for g in got) and got != plain


def test_allowed_token_ids_equal_hf_prefix_allowed_tokens(engine, hf_tiny, prompts):
    allowed = [3, 50, 51, 200, 311, 400]
    got = generate(engine, prompts, allowed_token_ids=allowed)
    want = [
        hf_generate(hf_tiny, p, prefix_allowed_tokens_fn=lambda _batch, _ids: allowed)
        for p in prompts
    ]
    assert got == want
    assert {t for g in got for t in g} <= set(allowed)
    assert len({t for g in got for t in g}) > 2


def test_bad_words_equal_hf_bad_words_ids(engine, hf_tiny, prompts, tiny_model_dir):
    from octavo.engine.frontend.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(f"{tiny_model_dir}/tokenizer.json")
    plain = generate(engine, prompts)
    # Words the model writes on its own: their last tokens must now be avoided.
    words = [tokenizer.decode(plain[0][2:4]), tokenizer.decode(plain[1][5:6])]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=words)
    banned = engine.input_processor.process_inputs(prompts[0], params).bad_words_token_ids
    assert banned and any(len(w) > 1 for w in banned)
    # vLLM matches a word's first tokens in the output only; HF in prompt + output: prompts
    # must not end inside a word for the two to agree.
    assert not any(w[0] == p[-1] for w in banned if len(w) > 1 for p in prompts)
    got = generate(engine, prompts, bad_words=words)
    want = [hf_generate(hf_tiny, p, bad_words_ids=banned) for p in prompts]
    assert got == want and got != plain


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine, hf_tiny, prompts):
    got = [
        o.prompt_token_ids
        for o in run_to_completion(
            engine, prompts, SamplingParams(max_tokens=1, truncate_prompt_tokens=5)
        )
    ]
    assert got == [p[-5:] for p in prompts]
    tokens = generate(engine, prompts, truncate_prompt_tokens=5)
    assert tokens == [hf_greedy(hf_tiny, p[-5:], MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize(
    ("controls", "param"),
    [
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": {10**6: 1.0}}, "logit_bias"),  # outside the vocabulary
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_bad_controls_are_refused_by_name(engine, controls, param):
    with pytest.raises(ParameterError) as raised:
        engine.add_request("bad", [1, 2, 3], SamplingParams(**controls))
    assert raised.value.param == param
    assert not engine.has_unfinished_requests()


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(engine, prompts):
    # The same seeded samples, all returned with their logprobs: the oracle's ranking.
    sampled = dict(temperature=1.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    (every,) = run_to_completion(engine, prompts[:1], SamplingParams(n=5, logprobs=0, **sampled))
    ranked = sorted(every.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    (best,) = run_to_completion(engine, prompts[:1], SamplingParams(n=2, best_of=5, **sampled))
    assert [c.index for c in best.outputs] == [0, 1]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    got = [c.cumulative_logprob for c in best.outputs]
    assert got == pytest.approx([c.cumulative_logprob for c in ranked[:2]], abs=1e-4)
    assert best.outputs[0].logprobs is None  # not asked for: used for ranking only
    assert len({tuple(c.token_ids) for c in every.outputs}) == 5


def test_best_of_below_n_is_refused(engine):
    with pytest.raises(ParameterError) as raised:
        SamplingParams(n=3, best_of=2)
    assert raised.value.param == "best_of"


def test_the_callers_params_stay_as_made_and_serve_any_number_of_requests(engine):
    """What the engine derives (the bad words' token ids, the grammar) goes with the request,
    not onto the caller's object: one params object shared by requests is never written."""
    from dataclasses import asdict

    from octavo.engine.structured_outputs import StructuredOutputsParams

    words = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, bad_words=["the"])
    choice = SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes"])
    )
    made = asdict(words), asdict(choice)  # its fields (its cached properties aside)
    processed = engine.input_processor.process_inputs([1, 2, 3], words)
    assert processed.bad_words_token_ids and processed.grammar is None
    assert engine.input_processor.process_inputs([1, 2, 3], choice).grammar
    outputs = run_to_completion(engine, [[1, 2, 3]] * 2 + [[4, 5]] * 2, [words] * 2 + [choice] * 2)
    assert (asdict(words), asdict(choice)) == made
    assert [o.outputs[0].text for o in outputs[2:]] == ["yes", "yes"]
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_bad_words_past_the_models_vocabulary_are_refused(tiny_model_dir):
    from octavo.engine.core_messages import ModelLimits
    from octavo.engine.frontend.input_processor import InputProcessor
    from octavo.engine.frontend.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(f"{tiny_model_dir}/tokenizer.json")
    # A model with fewer tokens than its tokenizer: a word's ids may lie past its logits.
    limits = ModelLimits(vocab_size=8, max_model_len=64, eos_token_ids=[0], max_num_seqs=4,
                         block_size=16, num_usable_blocks=64)  # fmt: skip
    processor = InputProcessor(tokenizer, limits)
    with pytest.raises(ParameterError) as raised:
        processor.process_inputs([1, 2], SamplingParams(bad_words=["definition"]))
    assert raised.value.param == "bad_words"


@pytest.mark.parametrize(
    ("overrides", "varies"),
    [
        ({"temperature": 1e308}, True),  # every token alike
        ({"repetition_penalty": 1e308}, True),
        ({"temperature": 1e-308}, False),  # greedy
        ({"temperature": 1e-40}, False),
        ({"repetition_penalty": 1e-308}, False),  # repeats forced
        ({"top_p": 1e-308}, False),  # the top token alone
        ({"temperature": 0.5, "logit_bias": {300: 1e308, 301: 1e308}}, True),
        ({"temperature": 1e-4, "logit_bias": {300: 1e30}, "repetition_penalty": 1e-30}, False),
    ],
)
def test_parameters_at_floats_edges_keep_the_masks(engine, prompts, overrides, varies):
    # Past float32's range (or below its smallest normal) a parameter became inf or 0 in the
    # sampler, and inf or 0 against a masked token's -inf, or inf - inf in a softmax, is NaN,
    # which the draw picked: token 0, outside the allowed ones, every time.
    allowed = [300, 301, 302]
    params = [
        SamplingParams(
            **{"temperature": 1.0} | overrides,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            allowed_token_ids=allowed,
            seed=i,
        )
        for i in range(len(prompts))
    ]
    tokens = [t for o in run_to_completion(engine, prompts, params) for t in o.outputs[0].token_ids]
    assert len(tokens) == len(prompts) * MAX_TOKENS and set(tokens) <= set(allowed)
    if varies:  # sampled, not stuck on one token
        assert len(set(tokens)) > 1


def test_a_logit_bias_past_float32_forces_its_tokens(engine, prompts):
    # A bias of 1e308 added inf to the logits, and inf - inf in the softmax is NaN, which the
    # draw picked (token 0): now it is bounded, and forces the token as surely.
    params = [
        SamplingParams(
            temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=i, logit_bias=bias
        )
        for i, bias in enumerate([{300: 1e308}, {300: 1e308, 301: 1e308}] * 3)
    ]
    outputs = run_to_completion(engine, prompts, params)
    assert all(set(o.outputs[0].token_ids) == {300} for o in outputs[0::2])
    both = [t for o in outputs[1::2] for t in o.outputs[0].token_ids]
    assert set(both) == {300, 301}


def test_every_eos_of_the_generation_config_ends_a_sample_as_in_hf(
    tiny_model_dir, hf_tiny, prompts, tmp_path
):
    """generation_config.json may list several EOS tokens (a chat model's end of turn beside
    its end of text): each ends a sample with finish_reason "stop" and no stop_reason, as HF
    generate stops on each; ignore_eos ignores them all."""
    import json

    from tests.checkpoints import with_eos

    tokens = [t for prompt in prompts for t in hf_generate(hf_tiny, prompt)]
    second = max(set(tokens), key=tokens.count)  # a token the greedy outputs write often
    folder = with_eos(tiny_model_dir, tmp_path / "eos", 0)
    generation = tmp_path / "eos" / "generation_config.json"
    config = json.loads(generation.read_text()) | {"eos_token_id": [0, second]}
    generation.write_text(json.dumps(config))
    engine = LLMEngine(EngineConfig(model=folder, device="cpu", dtype="float32", num_blocks=512))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = [o.outputs[0] for o in run_to_completion(engine, prompts, params)]
    stopped = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            want = hf_tiny.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                eos_token_id=[0, second], pad_token_id=0,
            )[0, len(prompt) :].tolist()  # fmt: skip
        assert output.token_ids == want
        if output.token_ids[-1] == second:
            stopped += 1
            assert (output.finish_reason, output.stop_reason) == ("stop", None)
    assert stopped > 0
    ignored = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for output in run_to_completion(engine, prompts, ignored):
        assert len(output.outputs[0].token_ids) == MAX_TOKENS
