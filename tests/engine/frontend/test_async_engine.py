"""AsyncEngine, with the core in a thread and in its own process: streams per request,
abort on close, queue bound, graceful shutdown, delta outputs, a killed core."""

import asyncio
import os
import signal
import time

import pytest

from octavo.engine import (
    BeamSearchParams,
    EngineConfig,
    LLMEngine,
    RequestOutputKind,
    SamplingParams,
)
from octavo.engine.frontend.async_engine import AsyncEngine, EngineStoppedError, QueueFullError

MODES = ["in_process", "multiprocess"]


def make(
    model_dir: str, max_num_waiting: int = 8, mode: str = "in_process", max_num_seqs: int = 2
) -> AsyncEngine:
    config = EngineConfig(
        model=model_dir, device="cpu", num_blocks=128, block_size=8, max_num_seqs=max_num_seqs
    )
    if mode == "multiprocess":
        return AsyncEngine.multiprocess(config, max_num_waiting, core_threads=1)
    return AsyncEngine.in_process(config, max_num_waiting)


def all_blocks_free(engine: AsyncEngine) -> bool:
    stats = engine.stats()
    return stats.num_free_blocks == stats.num_usable_blocks


def submit(engine: AsyncEngine, request_id: str, prompt, **params):
    params = SamplingParams(**({"temperature": 0, "max_tokens": 6} | params))
    return engine.add_request(
        request_id, engine.process_inputs(prompt, params), params, time.monotonic()
    )


async def drain(stream) -> list:
    return [output async for output in stream]


@pytest.mark.parametrize("mode", MODES)
def test_streams_match_the_sync_engine_and_blocks_come_back(tiny_model_dir, mode):
    async def main():
        engine = make(tiny_model_dir, mode=mode)
        engine.start()
        outs = await asyncio.gather(
            *(drain(submit(engine, f"r{i}", [i + 1] * (i + 3))) for i in range(5))
        )
        free = all_blocks_free(engine)
        await engine.shutdown(grace_seconds=1)
        return free, outs

    free, outs = asyncio.run(main())
    sync = LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", num_blocks=128, block_size=8))
    for i, stream in enumerate(outs):
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        sync.add_request("x", [i + 1] * (i + 3), SamplingParams(temperature=0, max_tokens=6))
        while sync.has_unfinished_requests():
            final = sync.step()
        assert stream[-1].outputs[0].token_ids == final[0].outputs[0].token_ids
    assert free


@pytest.mark.parametrize("mode", MODES)
def test_closing_a_stream_aborts_its_request(tiny_model_dir, mode):
    async def main():
        engine = make(tiny_model_dir, mode=mode)
        engine.start()
        stream = submit(engine, "long", [3] * 20, max_tokens=200, ignore_eos=True)
        await anext(stream)
        await stream.aclose()
        for _ in range(100):
            if engine.stats().num_running_seqs == 0:
                break
            await asyncio.sleep(0.01)
        stats = engine.stats()
        await engine.shutdown(grace_seconds=0)
        return stats

    stats = asyncio.run(main())
    assert stats.num_running_seqs == 0 and stats.kv_cache_usage == 0


@pytest.mark.parametrize("mode", MODES)
def test_queue_bound_and_shutdown_abort(tiny_model_dir, mode):
    async def main():
        engine = make(tiny_model_dir, max_num_waiting=2, mode=mode)
        engine.start()
        # As long as the tiny model's context allows: at a fraction of a millisecond a step
        # they must still be running when the engine shuts down.
        streams = [
            submit(engine, f"r{i}", [5, 6], max_tokens=250, ignore_eos=True) for i in range(2)
        ]
        with pytest.raises(QueueFullError):
            submit(engine, "overflow", [5, 6])
        engine.discard("nothing")  # unknown ids are fine
        tasks = [asyncio.create_task(drain(s)) for s in streams]
        await asyncio.sleep(0.01)
        await engine.shutdown(grace_seconds=0)
        with pytest.raises(EngineStoppedError):
            submit(engine, "late", [5])
        return [await t for t in tasks], all_blocks_free(engine)

    results, free = asyncio.run(main())
    for outputs in results:
        assert outputs[-1].finished
        assert {o.finish_reason for o in outputs[-1].outputs} <= {"abort", "length"}
    assert any(o.finish_reason == "abort" for r in results for o in r[-1].outputs)
    assert free


def test_bad_input_raises_before_anything_is_queued(tiny_model_dir):
    engine = make(tiny_model_dir)
    with pytest.raises(ValueError, match="prompt"):
        engine.process_inputs([], SamplingParams())
    assert engine.num_waiting == 0


def test_delta_streams_concatenate_to_the_final_output_for_every_request_kind(tiny_model_dir):
    """n > 1 with logprobs and stop strings, seeded sampling and greedy: a DELTA stream's
    outputs, merged, equal the FINAL_ONLY output of the same request."""
    kinds = [
        {"n": 3, "temperature": 0.9, "seed": 7, "logprobs": 2, "stop": [" the", "e"]},
        {"temperature": 0, "max_tokens": 12, "stop": ["ab"], "include_stop_str_in_output": True},
        {"n": 2, "temperature": 1.0, "seed": 1, "max_tokens": 9},
    ]

    async def main():
        engine = make(tiny_model_dir, max_num_waiting=16, max_num_seqs=8)
        engine.start()
        results = []
        for i, params in enumerate(kinds):
            delta = drain(submit(engine, f"d{i}", "Hello world", **params,
                                 output_kind=RequestOutputKind.DELTA))  # fmt: skip
            final = drain(submit(engine, f"f{i}", "Hello world", **params,
                                 output_kind=RequestOutputKind.FINAL_ONLY))  # fmt: skip
            results.append((await delta, await final))
        await engine.shutdown(grace_seconds=1)
        return results

    for deltas, (final,) in asyncio.run(main()):
        merged = deltas[0]
        for later in deltas[1:]:
            merged.add(later)
        assert merged.finished and len(merged.outputs) == len(final.outputs)
        for got, want in zip(merged.outputs, final.outputs, strict=True):
            assert (got.index, got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
                want.index, want.text, want.token_ids, want.finish_reason, want.stop_reason
            )  # fmt: skip
            # A sample stopped by a stop string leaves the batch a step later or not, which
            # moves the others' floats in the last bits: values agree, not bit for bit.
            if want.cumulative_logprob is None:  # no logprobs asked for: none reported
                assert got.cumulative_logprob is None
            else:
                assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)
            if want.logprobs is not None:
                assert [list(d) for d in got.logprobs] == [list(d) for d in want.logprobs]


def test_beam_search_streams_only_its_final_output(tiny_model_dir):
    params = BeamSearchParams(beam_width=3, max_tokens=6, num_return_sequences=2)

    async def main():
        engine = make(tiny_model_dir, max_num_seqs=8)
        engine.start()
        prompt = engine.process_inputs([5, 6, 7], params)
        outputs = await drain(engine.add_request("beam", prompt, params, time.monotonic()))
        await engine.shutdown(grace_seconds=1)
        return outputs

    outputs = asyncio.run(main())
    sync = LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", num_blocks=128, block_size=8))
    sync.add_request("beam", [5, 6, 7], params)
    while sync.has_unfinished_requests():
        final = sync.step()
    (output,) = outputs
    assert output.finished and [c.token_ids for c in output.outputs] == [
        c.token_ids for c in final[0].outputs
    ]


def test_a_killed_core_process_fails_every_stream_and_calls_the_fatal_handler(tiny_model_dir):
    async def main():
        engine = make(tiny_model_dir, mode="multiprocess")
        fatal: list[BaseException] = []
        engine.on_fatal(fatal.append)
        engine.start()
        streams = [
            submit(engine, f"r{i}", [5, 6], max_tokens=10_000, ignore_eos=True) for i in range(2)
        ]
        await anext(streams[0])  # the core is stepping
        os.kill(engine.client.process.pid, signal.SIGKILL)
        results = []
        for stream in streams:
            try:
                await asyncio.wait_for(drain(stream), timeout=10)
            except EngineStoppedError as exc:
                results.append(exc)
        accepting = engine.accepting
        await engine.shutdown(grace_seconds=0)
        return results, fatal, accepting

    results, fatal, accepting = asyncio.run(main())
    assert len(results) == 2 and all("died" in str(r) for r in results)
    assert len(fatal) == 1 and "-9" in str(fatal[0]) and not accepting
