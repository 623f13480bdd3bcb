"""Greedy continuous batching equals HF greedy generate, prompt by prompt, token for token."""

import pytest

from octavo.engine import EngineConfig, LLMEngine, SamplingParams
from tests.checkpoints import sample_prompts
from tests.engine.helpers import hf_greedy, run_to_completion

NUM_PROMPTS = 18
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(hf_tiny):
    return sample_prompts(NUM_PROMPTS, 1, 200, hf_tiny.config.vocab_size, seed=0)


@pytest.fixture(scope="module")
def expected(hf_tiny, prompts):
    return [hf_greedy(hf_tiny, p, MAX_TOKENS) for p in prompts]


@pytest.fixture(params=[False, True], ids=["sync", "async_scheduling"])
def async_scheduling(request) -> bool:
    """Every parity test also runs one step ahead: tokens reach the host a step late."""
    return request.param


def engine_for(model_dir, async_scheduling: bool, **overrides) -> LLMEngine:
    config = {
        "async_scheduling": async_scheduling,
        "model": model_dir,
        "device": "cpu",
        "dtype": "float32",
        "num_blocks": 512,
        "block_size": 16,
    } | overrides
    return LLMEngine(EngineConfig(**config))


def check(outputs, expected):
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i}: {g} != {e}"
    # The oracle itself must exercise something: varied tokens, some EOS, some full-length.
    assert len({t for e in expected for t in e}) > 20
    reasons = {o.outputs[0].finish_reason for o in outputs}
    assert reasons <= {"stop", "length"}


def test_batched_greedy_equals_hf_alone(tiny_model_dir, prompts, expected, async_scheduling):
    engine = engine_for(tiny_model_dir, async_scheduling)
    check(
        run_to_completion(engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)),
        expected,
    )


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_chunked_prefill_under_a_small_token_budget(
    tiny_model_dir, prompts, expected, block_size, async_scheduling
):
    engine = engine_for(
        tiny_model_dir,
        async_scheduling,
        max_num_batched_tokens=37,
        block_size=block_size,
        num_blocks=8192 // block_size,
    )
    outputs = run_to_completion(
        engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    )
    check(outputs, expected)


@pytest.mark.parametrize("prefill_interval", [1, 3])
def test_preemption_by_recompute_changes_no_token(
    tiny_model_dir, prompts, expected, async_scheduling, prefill_interval
):
    """Also with admissions every third step at most: preempted requests wait for theirs."""
    # 40 blocks of 8 tokens: one longest request (224 tokens, 28 blocks) fits, all 18 do not.
    engine = engine_for(
        tiny_model_dir, async_scheduling, num_blocks=40, block_size=8, max_num_batched_tokens=96,
        prefill_interval=prefill_interval,
    )  # fmt: skip
    outputs = run_to_completion(
        engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    )
    assert engine.stats().num_preemptions > 0
    check(outputs, expected)


def test_greedy_with_frequent_eos_equals_hf(eos_model_dir, hf_eos, prompts, async_scheduling):
    expected = [hf_greedy(hf_eos, p, MAX_TOKENS) for p in prompts]
    engine = engine_for(
        eos_model_dir, async_scheduling, num_blocks=40, block_size=8, max_num_batched_tokens=64
    )
    outputs = run_to_completion(
        engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    )
    check(outputs, expected)
    reasons = [o.outputs[0].finish_reason for o in outputs]
    assert reasons.count("stop") >= 3 and reasons.count("length") >= 1
