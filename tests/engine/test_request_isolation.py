"""One request's failure is its own: a fault while processing one request fails
that request, frees its blocks and leaves the others' tokens exactly as without it; a fault
of a step itself fails every in-flight request and calls the fatal handler; inputs that once
raised inside the engine are refused at validation instead."""

import asyncio
import math
import time

import pytest

from octavo.engine import BeamSearchParams, EngineConfig, LLMEngine, SamplingParams
from octavo.engine.core.beam_state import length_normalizer, normalized_score
from octavo.engine.errors import ParameterError
from octavo.engine.frontend.async_engine import AsyncEngine, EngineStoppedError, RequestFailedError
from tests.checkpoints import sample_prompts
from tests.engine.helpers import hf_greedy, run_to_completion

VICTIM = "req-2"


def engine_for(model_dir: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=model_dir, device="cpu", dtype="float32", num_blocks=256, block_size=4)
    )


def poison(engine: LLMEngine | AsyncEngine, request_id: str, where: str) -> None:
    """Makes building `request_id`'s outputs (detokenizing, in the output processor) or its
    beam step (in the core) raise."""
    if where == "output":
        processor = engine.output_processor
        apply = processor._apply

        def poisoned_apply(state, sample, delta):
            if state.request_id == request_id:
                raise RuntimeError("injected output fault")
            apply(state, sample, delta)

        processor._apply = poisoned_apply
    else:
        step = engine.scheduler.beam_search.step

        def beam_step(group, candidates):
            if group.request_id == request_id:
                raise ZeroDivisionError("injected beam fault")
            step(group, candidates)

        engine.scheduler.beam_search.step = beam_step


@pytest.mark.parametrize("where", ["output", "beam"])
def test_a_fault_in_one_request_fails_it_alone(tiny_model_dir, hf_tiny, where):
    engine = engine_for(tiny_model_dir)
    prompts = sample_prompts(5, 3, 30, hf_tiny.config.vocab_size, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    params = [greedy] * 5
    if where == "beam":
        params[2] = BeamSearchParams(beam_width=3, max_tokens=12)
    poison(engine, VICTIM, where)
    outputs = run_to_completion(engine, prompts, params)  # invariants checked every step
    failed = outputs[2]
    assert failed.finished and failed.error is not None and "injected" in failed.error
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        if i != 2:
            assert output.error is None
            assert output.outputs[0].token_ids == hf_greedy(hf_tiny, prompt, 12)
    assert not engine.has_unfinished_requests()


def test_out_of_range_seeds_are_refused_before_anything_runs(tiny_model_dir):
    for seed in (2**64 - 1, 2**63, -(2**63) - 1, True, 1.5):
        with pytest.raises(ParameterError) as error:
            SamplingParams(seed=seed, n=2)
        assert error.value.param == "seed"
    engine = engine_for(tiny_model_dir)
    outputs = run_to_completion(
        engine, [[1, 2, 3]] * 2, [SamplingParams(seed=s, n=4) for s in (2**63 - 1, -(2**63))]
    )
    assert all(len(o.outputs) == 4 for o in outputs)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("repetition_penalty", math.nan),
        ("repetition_penalty", math.inf),
        ("top_p", math.nan),
        ("max_tokens", True),
        ("n", True),
        ("top_k", 1.0),
    ],
)
def test_non_finite_and_bool_values_are_refused(field, value):
    with pytest.raises(ParameterError) as error:
        SamplingParams(**{field: value})
    assert error.value.param == field


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True])
def test_beam_length_penalty_must_be_a_finite_number(value):
    with pytest.raises(ParameterError) as error:
        BeamSearchParams(beam_width=2, length_penalty=value)
    assert error.value.param == "length_penalty"


def test_length_normalization_never_raises():
    assert length_normalizer(1024, 400.0) == math.inf
    assert length_normalizer(1024, -1e308) == 0.0
    assert normalized_score(-3.0, 1024, -1e308) == -math.inf
    assert normalized_score(-3.0, 1024, 400.0) == 0.0
    assert normalized_score(-3.0, 4, 1.0) == -0.75  # the ordinary case is HF's arithmetic


@pytest.mark.parametrize("length_penalty", [400.0, -1e308, 1e308, -400.0])
def test_extreme_length_penalties_run_to_the_end(eos_model_dir, length_penalty):
    engine = engine_for(eos_model_dir)
    params = BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=length_penalty)
    outputs = run_to_completion(engine, [[5, 6, 7], [9] * 20], params)
    for output in outputs:
        assert output.error is None and len(output.outputs) == 1


def make_async(model_dir: str) -> AsyncEngine:
    config = EngineConfig(
        model=model_dir, device="cpu", dtype="float32", num_blocks=256, block_size=4
    )
    return AsyncEngine.in_process(config, max_num_waiting=8)


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int]):
    params = SamplingParams(temperature=0, max_tokens=8)
    stream = engine.add_request(
        request_id, engine.process_inputs(prompt, params), params, time.monotonic()
    )
    try:
        return [output async for output in stream]
    except Exception as exc:  # noqa: BLE001 -- the test inspects it
        return exc


def test_the_async_engine_fails_one_stream_and_serves_the_others(tiny_model_dir):
    async def main():
        engine = make_async(tiny_model_dir)
        poison(engine, "bad", "output")
        engine.start()
        results = await asyncio.gather(
            collect(engine, "good-1", [1, 2, 3]),
            collect(engine, "bad", [4, 5, 6]),
            collect(engine, "good-2", [7, 8, 9]),
        )
        after = await collect(engine, "later", [1, 2])  # the loop is alive
        await engine.shutdown(grace_seconds=1)
        return engine, results, after

    engine, (good_1, bad, good_2), after = asyncio.run(main())
    assert isinstance(bad, RequestFailedError) and "injected" in str(bad)
    for outputs in (good_1, good_2, after):
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 8
    assert engine.accepting is False  # shut down on purpose, not dead
    bm = engine.client.core.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_a_step_fault_fails_every_stream_and_calls_the_fatal_handler(tiny_model_dir):
    async def main():
        engine = make_async(tiny_model_dir)
        fatal: list[BaseException] = []
        engine.on_fatal(fatal.append)

        def broken_step(output):
            raise RuntimeError("injected step fault")

        engine.client.core.step_observers.append(broken_step)
        engine.start()
        results = await asyncio.wait_for(
            asyncio.gather(collect(engine, "a", [1, 2, 3]), collect(engine, "b", [4, 5])),
            timeout=30,
        )
        return engine, results, fatal

    engine, results, fatal = asyncio.run(main())
    assert all(isinstance(r, EngineStoppedError) for r in results), results
    assert len(fatal) == 1 and "injected step fault" in str(fatal[0])
    assert not engine.accepting


def test_a_request_aborted_before_it_forks_reports_all_n_choices(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    engine.add_request("n4", [1, 2, 3], SamplingParams(n=4, max_tokens=5, logprobs=1))
    final = engine.abort_request("n4")
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(c.finish_reason == "abort" and c.token_ids == [] for c in final.outputs)
    assert all(c.logprobs == [] for c in final.outputs)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
