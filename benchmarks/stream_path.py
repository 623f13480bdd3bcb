"""The API process's own work per streamed event, in one process and without sockets.

The real FastAPI app over an `AsyncEngine` whose core client is a stand-in: each "step" hands
the engine one token for every stream (the core's message, already decoded), and the step
ends when every stream has written its event. The events go to an ASGI `send` that only
counts them, so what is timed is this process's Python per event: applying the core's
outputs (detokenizing every token with the default model's tokenizer), waking each stream,
building its output and chunk, and the app's send path, without the socket write and the
kernel's share that `api_throughput.py` includes. It is steadier than that benchmark (no
clients, no other processes), which makes it the one to compare two checkouts with:
--before-root runs this same script against another checkout's `octavo` (PYTHONPATH),
alternating with this one.

    .venv/bin/python benchmarks/stream_path.py --streams 256 --repeats 4 --before-root /tmp/before

CPU per event is the process's CPU time over timed windows of --window-steps steps, after
--warmup-steps; each run keeps its fastest window (noise on a shared machine only adds) and
the median window. Speed is never asserted in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

try:
    import octavo.engine  # noqa: F401
except ImportError:  # run as a plain script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uvloop

from octavo.benchmarks.common import machine_info
from octavo.benchmarks.provenance import git_commit, write_result
from octavo.engine.core_messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineStats,
    ModelLimits,
    SampleDelta,
)
from octavo.engine.frontend.async_engine import AsyncEngine
from octavo.engine.frontend.core_client import EngineCoreClient
from octavo.engine.frontend.tokenizer import load_tokenizer
from octavo.server.app import create_app
from octavo.server.server_args import DEFAULT_MODEL
from octavo.server.serving_engine import ServerConfig

MODEL_NAME = "bench"
# The stand-in core's model and cache, as far as the front end's validation is concerned.
VOCAB_SIZE = 50257
MAX_MODEL_LEN = 1 << 20
FAKE_NUM_BLOCKS = 1 << 20
BLOCK_SIZE = 16
PROMPT = "Streams of tokens, one event each"
# Loop turns given to the streams' requests to reach the engine before the first step.
ADMISSION_TURNS = 50
# A step whose events have not all been written by then has lost a stream.
STEP_TIMEOUT_S = 60.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--window-steps", type=int, default=30)
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3, help="runs per checkout")
    parser.add_argument("--before-root", type=Path, default=None,
                        help="also run against this checkout of Octavo, alternating")  # fmt: skip
    parser.add_argument("--result-file", type=Path, default=None)
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _stats(num_requests: int) -> EngineStats:
    return EngineStats(num_requests, 0, FAKE_NUM_BLOCKS, FAKE_NUM_BLOCKS, 0.0, 0, 0, 0,
                       num_requests, 0, 0, 0)  # fmt: skip


class StandInClient(EngineCoreClient):
    """Takes the engine's requests and lets the benchmark hand it outputs."""

    def __init__(self, max_num_seqs: int):
        self.limits = ModelLimits(
            VOCAB_SIZE, MAX_MODEL_LEN, None, max_num_seqs, BLOCK_SIZE, FAKE_NUM_BLOCKS
        )
        self.initial_stats = _stats(0)
        self.request_ids: list[str] = []

    def start(self, loop, on_outputs, on_death) -> None:
        self.on_outputs = on_outputs

    def send(self, inputs) -> None:
        self.request_ids += [request.request_id for request in inputs.requests]

    def close(self) -> None:
        pass


async def measure(args: argparse.Namespace) -> dict:
    """Every window's CPU microseconds per event, and the events written in all."""
    client = StandInClient(args.streams)
    tokenizer = load_tokenizer(str(DEFAULT_MODEL), "auto")
    engine = AsyncEngine(client, tokenizer, max_num_waiting=args.streams)
    app = create_app(engine, ServerConfig(served_model_name=MODEL_NAME))
    engine.start()
    loop = asyncio.get_running_loop()
    events = 0
    due: tuple[int, asyncio.Future[None]] | None = None  # the step's last event, its waiter

    async def send(message: dict) -> None:
        nonlocal events, due
        if message["type"] == "http.response.body" and message.get("body"):
            events += 1
            if due is not None and events >= due[0]:
                due[1].set_result(None)
                due = None

    num_steps = args.warmup_steps + args.window_steps * args.windows
    body = json.dumps({"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": num_steps + 1,
                       "stream": True, "ignore_eos": True}).encode()  # fmt: skip
    never = loop.create_future()

    def receive_for_one_request():
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never  # the client stays
            raise AssertionError("unreachable")

        return receive

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }  # fmt: skip
    responses = [
        asyncio.create_task(app(dict(scope), receive_for_one_request(), send))
        for _ in range(args.streams)
    ]
    for _ in range(ADMISSION_TURNS):
        await asyncio.sleep(0)
    if len(client.request_ids) != args.streams:
        raise RuntimeError(f"{len(client.request_ids)} of {args.streams} streams started")

    async def step(number: int) -> None:
        nonlocal due
        outputs = [
            EngineCoreOutput(request_id, [SampleDelta(0, [(number * 7 + i) % (VOCAB_SIZE - 1)],
                                                      -1.0, None, None)], False)
            for i, request_id in enumerate(client.request_ids)
        ]  # fmt: skip
        done = loop.create_future()
        due = (events + args.streams, done)
        client.on_outputs(EngineCoreOutputs(outputs, _stats(args.streams)))
        try:
            await asyncio.wait_for(done, STEP_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"step {number}: {due[0] - events} events missing") from None

    number = 0
    for _ in range(args.warmup_steps):
        await step(number)
        number += 1
    gc.collect()
    # The start-up heap frozen as `octavo serve` freezes it, done here rather than by the
    # package's own call so that any checkout (--before-root) is measured alike.
    gc.freeze()
    windows = []
    for _ in range(args.windows):
        start = time.process_time()
        for _ in range(args.window_steps):
            await step(number)
            number += 1
        windows.append((time.process_time() - start) / (args.window_steps * args.streams) * 1e6)
    for response in responses:
        response.cancel()
    await asyncio.gather(*responses, return_exceptions=True)
    return {"windows": windows, "events": events}


def run_checkout(root: Path | None, args: argparse.Namespace) -> dict:
    """One run in a fresh process, against `root`'s octavo (None: this checkout)."""
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--once", "--streams", str(args.streams),
               "--warmup-steps", str(args.warmup_steps), "--window-steps",
               str(args.window_steps), "--windows", str(args.windows)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    fastest = [min(run["windows"]) for run in runs]
    medians = [statistics.median(run["windows"]) for run in runs]
    return {
        "events_per_run": [run["events"] for run in runs],
        "fastest_window_us_per_event": fastest,
        "median_window_us_per_event": medians,
        "best_us_per_event": min(fastest),
        "median_us_per_event": statistics.median(medians),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.once:
        print(json.dumps(uvloop.run(measure(args))))
        return 0
    root = Path(__file__).resolve().parents[1]
    checkouts: dict[str, Path | None] = {f"now@{git_commit(root)}": None}
    if args.before_root is not None:
        checkouts[f"before@{git_commit(args.before_root)}"] = args.before_root
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    for _ in range(args.repeats):
        for name, checkout in checkouts.items():
            runs[name].append(run_checkout(checkout, args))
    results = {name: summary(checkout_runs) for name, checkout_runs in runs.items()}
    for name, result in results.items():
        print(f"{name}: {result['best_us_per_event']:.2f} us per event at best, "
              f"median window {result['median_us_per_event']:.2f}")  # fmt: skip
    write_result(args.result_file, {
        "benchmark": "stream_path",
        "machine": machine_info("cpu"),
        "commit": git_commit(root),
        "workload": {"streams": args.streams, "window_steps": args.window_steps,
                     "windows": args.windows, "tokens_per_event": 1},
        "checkouts": results,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
