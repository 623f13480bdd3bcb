"""A request that wants only its final output (no stop strings, no per-token logprobs) costs
its front end nothing per token: the core sends each sample's tokens once, when it finishes,
and they are the tokens a stream of the same request gets, one step at a time."""

import pytest

from octavo.engine import EngineConfig, LLMEngine, SamplingParams
from octavo.engine.sampling_params import RequestOutputKind
from tests.checkpoints import sample_prompts

MAX_TOKENS = 12


def make_engine(model_dir, async_scheduling: bool) -> LLMEngine:
    config = EngineConfig(
        model=model_dir, device="cpu", num_blocks=256, block_size=8,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    return LLMEngine(config)


def core_outputs(engine: LLMEngine, prompts, params: SamplingParams):
    """Every EngineCoreOutput the core produced, step by step, while `engine.step()` ran
    until all requests ended."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    produced = []
    core_step = engine.core.step

    def recorded_step():
        outputs = core_step()
        produced.append(outputs.outputs)
        return outputs

    engine.core.step = recorded_step
    while engine.has_unfinished_requests():
        engine.step()
    return produced


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async_scheduling"])
@pytest.mark.parametrize("n", [1, 3])
def test_final_only_tokens_come_once_and_equal_the_streamed_ones(
    tiny_model_dir, hf_tiny, async_scheduling, n
):
    prompts = sample_prompts(4, 3, 20, hf_tiny.config.vocab_size, seed=2)
    common = {"n": n, "seed": 11, "temperature": 0.9, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    final = SamplingParams(**common, output_kind=RequestOutputKind.FINAL_ONLY)
    streamed = SamplingParams(**common, output_kind=RequestOutputKind.DELTA)
    final_steps = core_outputs(make_engine(tiny_model_dir, async_scheduling), prompts, final)
    stream_steps = core_outputs(make_engine(tiny_model_dir, async_scheduling), prompts, streamed)

    def tokens(steps) -> dict[tuple[str, int], list[int]]:
        gathered: dict[tuple[str, int], list[int]] = {}
        for step in steps:
            for output in step:
                for sample in output.samples:
                    gathered.setdefault((output.request_id, sample.index), []).extend(
                        sample.new_token_ids
                    )
        return gathered

    assert tokens(final_steps) == tokens(stream_steps)
    assert len(tokens(final_steps)) == len(prompts) * n
    # Final-only: a sample appears once, with its finish and all of its tokens.
    samples = [(o, s) for step in final_steps for o in step for s in o.samples]
    assert len(samples) == len(prompts) * n
    assert all(
        s.finish_reason == "length" and len(s.new_token_ids) == MAX_TOKENS for _, s in samples
    )
    assert all(o.first_token_time is not None for o, _ in samples if o.finished)
    # Streamed: one token a step.
    stream_samples = [s for step in stream_steps for o in step for s in o.samples]
    assert all(len(s.new_token_ids) == 1 for s in stream_samples)


def test_an_aborted_final_only_request_returns_the_tokens_it_had(tiny_model_dir, hf_tiny):
    engine = make_engine(tiny_model_dir, async_scheduling=False)
    prompt = sample_prompts(1, 5, 5, hf_tiny.config.vocab_size, seed=3)[0]
    params = SamplingParams(
        max_tokens=100, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    engine.add_request("r", prompt, params)
    for _ in range(6):
        assert engine.step() == []  # nothing to say before its end
    final = engine.abort_request("r")
    assert final is not None and final.finished
    (completion,) = final.outputs
    assert completion.finish_reason == "abort"
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = make_engine(tiny_model_dir, async_scheduling=False)
    expected.add_request("e", prompt, greedy)
    while expected.has_unfinished_requests():
        done = [o for o in expected.step() if o.finished]
    assert completion.token_ids == done[0].outputs[0].token_ids
    assert completion.text == done[0].outputs[0].text
    assert final.metrics is not None and final.metrics.first_token_time is not None
    assert final.metrics.first_token_time < final.metrics.finished_time
