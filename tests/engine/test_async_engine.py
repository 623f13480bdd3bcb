"""AsyncEngine: streams per request, abort on close, queue bound, graceful shutdown."""

import asyncio
import time

import pytest

from octavo.engine import EngineConfig, LLMEngine, SamplingParams
from octavo.engine.async_engine import AsyncEngine, EngineStoppedError, QueueFullError


def make(model_dir: str, max_num_waiting: int = 8) -> AsyncEngine:
    config = EngineConfig(
        model=model_dir, device="cpu", num_blocks=128, block_size=8, max_num_seqs=2
    )
    return AsyncEngine(LLMEngine(config), max_num_waiting)


def submit(engine: AsyncEngine, request_id: str, prompt, **params):
    params = SamplingParams(**({"temperature": 0, "max_tokens": 6} | params))
    return engine.add_request(
        request_id, engine.process_inputs(prompt, params), params, time.monotonic()
    )


async def drain(stream) -> list:
    return [output async for output in stream]


def test_streams_match_the_sync_engine_and_blocks_come_back(tiny_model_dir):
    async def main():
        engine = make(tiny_model_dir)
        engine.start()
        outs = await asyncio.gather(
            *(drain(submit(engine, f"r{i}", [i + 1] * (i + 3))) for i in range(5))
        )
        await engine.shutdown(grace_seconds=1)
        return engine, outs

    engine, outs = asyncio.run(main())
    sync = LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", num_blocks=128, block_size=8))
    for i, stream in enumerate(outs):
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        sync.add_request("x", [i + 1] * (i + 3), SamplingParams(temperature=0, max_tokens=6))
        while sync.has_unfinished_requests():
            final = sync.step()
        assert stream[-1].outputs[0].token_ids == final[0].outputs[0].token_ids
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_closing_a_stream_aborts_its_request(tiny_model_dir):
    async def main():
        engine = make(tiny_model_dir)
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


def test_queue_bound_and_shutdown_abort(tiny_model_dir):
    async def main():
        engine = make(tiny_model_dir, max_num_waiting=2)
        engine.start()
        streams = [
            submit(engine, f"r{i}", [5, 6], max_tokens=100, ignore_eos=True) for i in range(2)
        ]
        with pytest.raises(QueueFullError):
            submit(engine, "overflow", [5, 6])
        engine.discard("nothing")  # unknown ids are fine
        tasks = [asyncio.create_task(drain(s)) for s in streams]
        await asyncio.sleep(0.05)
        await engine.shutdown(grace_seconds=0)
        with pytest.raises(EngineStoppedError):
            submit(engine, "late", [5])
        return [await t for t in tasks], engine

    results, engine = asyncio.run(main())
    for outputs in results:
        assert outputs[-1].finished
        assert {o.finish_reason for o in outputs[-1].outputs} <= {"abort", "length"}
    assert any(o.finish_reason == "abort" for r in results for o in r[-1].outputs)
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_bad_input_raises_before_anything_is_queued(tiny_model_dir):
    engine = make(tiny_model_dir)
    with pytest.raises(ValueError, match="prompt"):
        engine.process_inputs([], SamplingParams())
    assert engine.num_waiting == 0
