"""The API process alone: how many streamed tokens/s it delivers, and its CPU per token, when
the engine core costs nothing.

A stand-in core (`run_fake_core`, same process entry point and messages as the real one)
answers every request with one token per "step" for each running request, --output-len
tokens each: as fast as it can, or (--step-ms) one step per interval at most, the regime of
a GPU-speed engine whose every event carries one token. The API process is the real one
(`create_app` over an `AsyncEngine` with the multiprocess client, the default model's
tokenizer detokenizing every token) pinned to CPU 0; the stand-in core and the clients
(raw-socket streams, in separate processes, see serving_throughput.py) are pinned to the
other CPUs, so the figure is what one core of API process does. When the clients read
slower than tokens arrive, pending deltas merge into one event: tokens per event is
reported. API CPU per request is reported too: with a few tokens per request, and
`--unstreamed` for plain responses, it is what admitting a burst of requests costs.

    .venv/bin/python -m benchmarks.api_throughput --concurrency 64 256
    .venv/bin/python -m benchmarks.api_throughput --concurrency 256 --step-ms 10
    .venv/bin/python -m benchmarks.api_throughput --concurrency 256 --output-len 2 --unstreamed

Speed is never asserted in tests; tests/benchmarks runs a tiny configuration.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from benchmarks import serving_throughput
from benchmarks.provenance import REPO_ROOT, header, host_info, write_result
from benchmarks.sse_client import free_port, run_clients, running_server
from benchmarks.workload import length_range
from octavo.engine.config import EngineConfig
from octavo.engine.core.core_process import CoreAddresses, connect_core_sockets
from octavo.engine.core_messages import (
    EngineCoreInputs,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineStats,
    ModelLimits,
    SampleDelta,
)

API_CPU = 0
# The stand-in core's KV cache, as far as the front end's validation is concerned.
FAKE_NUM_BLOCKS = 1 << 20
# Linux's clock type for a process's CPU time by scheduler accounting (nanoseconds).
CPUCLOCK_SCHED = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=length_range, default=(16, 16))
    parser.add_argument("--output-len", type=length_range, default=(256, 256))
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="the stand-in core's least time per step (0: no pause)")  # fmt: skip
    parser.add_argument("--unstreamed", action="store_true",
                        help="plain responses: each request's cost without its events")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", type=Path, default=None)
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- the stand-in core (a process of its own, spawned by MultiprocessCoreClient) ------------------


def run_fake_core(
    config: EngineConfig,
    addresses: CoreAddresses,
    num_threads: int | None,
    parent_pid: int,
    step_s: float = 0.0,
) -> None:
    """Every step gives each running request its next token (ids cycling through the
    vocabulary) until its max_tokens; aborts are honoured. A step starts `step_s` after the
    previous one at the earliest. No model, no cache."""
    os.sched_setaffinity(0, _other_cpus())
    model_config = json.loads((Path(config.model) / "config.json").read_text())
    vocab = model_config["vocab_size"]
    limits = ModelLimits(
        vocab, model_config["n_positions"], [], config.max_num_seqs, 16, FAKE_NUM_BLOCKS
    )
    _, inputs, (outputs,) = connect_core_sockets(addresses)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreInputs)
    running: dict[str, tuple[EngineCoreRequest, int]] = {}
    added = 0
    next_step = time.perf_counter()

    def stats() -> EngineStats:
        return EngineStats(
            len(running), 0, FAKE_NUM_BLOCKS, FAKE_NUM_BLOCKS, 0.0, 0, 0, 0, added, 0, 0, 0
        )

    outputs.send(encoder.encode(EngineCoreReady(limits, stats())))
    while True:
        while inputs.poll(0 if running else 1000):
            message = decoder.decode(inputs.recv())
            if message.shutdown:
                outputs.close(linger=1000)
                return
            for request in message.requests:
                running[request.request_id] = (request, 0)
                added += 1
            for request_id in message.aborts:
                running.pop(request_id, None)
        if not running:
            if os.getppid() != parent_pid:
                return
            continue
        wait = next_step - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        next_step = time.perf_counter() + step_s
        step: list[EngineCoreOutput] = []
        for request_id, (request, done) in list(running.items()):
            params = request.params
            done += 1
            finished = done >= params.max_tokens
            token = (done * 7 + len(request_id)) % (vocab - 1)
            delta = SampleDelta(0, [token], -float(done), None, "length" if finished else None)
            step.append(EngineCoreOutput(request_id, [delta], finished))
            if finished:
                del running[request_id]
            else:
                running[request_id] = (request, done)
        outputs.send(encoder.encode(EngineCoreOutputs(step, stats())))


def _other_cpus() -> set[int]:
    cpus = os.sched_getaffinity(0) - {API_CPU}
    return cpus or {API_CPU}


# -- the API process -------------------------------------------------------------------------------


def serve(port: int, model: Path, max_num_seqs: int, step_ms: float) -> None:
    """The real API process over the stand-in core, pinned to API_CPU."""
    import uvicorn

    from octavo.engine.frontend.async_engine import AsyncEngine
    from octavo.engine.frontend.core_client import MultiprocessCoreClient
    from octavo.engine.frontend.tokenizer import load_tokenizer
    from octavo.engine.heap import tune_collector_for_serving
    from octavo.server.app import create_app
    from octavo.server.serving_engine import ServerConfig

    config = EngineConfig(
        model=str(model), load_format="dummy", device="cpu", max_num_seqs=max_num_seqs
    )
    core = functools.partial(run_fake_core, step_s=step_ms / 1000)
    client = MultiprocessCoreClient(config, None, target=core)
    os.sched_setaffinity(0, {API_CPU})  # after the spawn: the core chose its own CPUs
    engine = AsyncEngine(client, load_tokenizer(str(model), "auto"), max_num_waiting=4096)
    app = create_app(engine, ServerConfig(served_model_name=serving_throughput.MODEL_NAME))
    tune_collector_for_serving()  # as `octavo serve` does
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", limit_concurrency=8192)


def process_cpu_seconds(pid: int) -> float:
    """CPU time of one process: all its threads, exited ones too, not its children.

    Read from the process's CPU-time clock, which counts nanoseconds. /proc/PID/stat counts
    clock ticks of 10 ms, coarser than a short run's API work (the smoke run's 60 tokens
    could read 0). Linux names another process's clock by its pid, as glibc's
    clock_getcpuclockid does: (~pid << 3) | CPUCLOCK_SCHED."""
    return time.clock_gettime((~pid << 3) | CPUCLOCK_SCHED)


def measure(model: Path, concurrency: int, args: argparse.Namespace, vocab: int) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.api_throughput", "--serve", str(port)]
    cmd += ["--model", str(model), "--step-ms", str(args.step_ms)]
    with running_server(cmd + ["--concurrency", str(concurrency)], port, cwd=REPO_ROOT) as server:
        run = argparse.Namespace(**{**vars(args), "num_requests": concurrency})
        requests = serving_throughput.make_requests(run, vocab)
        bodies = serving_throughput.bodies(requests, stream=not args.unstreamed)
        run_clients(port, bodies[:2], 1, _other_cpus())  # warm-up
        cpu_before = process_cpu_seconds(server.pid)
        result = run_clients(port, bodies, args.client_procs, _other_cpus())
        api_cpu = process_cpu_seconds(server.pid) - cpu_before
    # The client processes start before their first request (see run_clients); the API
    # process idles then, so all its CPU is the streams'.
    tokens = result["completion_tokens"]
    return {
        "concurrency": concurrency,
        **result,
        "api_cpu_s": api_cpu,
        "api_cpu_us_per_token": api_cpu / tokens * 1e6 if tokens else None,
        "api_cpu_us_per_request": api_cpu / concurrency * 1e6,
        # Every stream ends with its usage event and [DONE]: the others carry tokens.
        "tokens_per_event": (
            None if args.unstreamed else tokens / max(result["events"] - 2 * concurrency, 1)
        ),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.model, max(args.concurrency), args.step_ms)
        return 0
    if len(os.sched_getaffinity(0)) < 2:
        print("needs at least 2 CPUs: one for the API process, one for the rest")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        shape = argparse.Namespace(
            layers=1, hidden=16, heads=1, prompt_len=args.prompt_len, output_len=args.output_len
        )
        vocab = serving_throughput.write_model(model, shape)
        runs = [measure(model, c, args, vocab) for c in args.concurrency]
    for run in runs:
        print(
            f"{run['concurrency']:>4} streams: {run['tokens_per_s']:>9,.0f} tok/s, "
            f"API CPU {run['api_cpu_us_per_token']:.1f} us/token, "
            f"{run['api_cpu_us_per_request']:.0f} us/request, "
            + ("" if args.unstreamed else f"{run['tokens_per_event']:.1f} tokens/event, ")
            + f"failed {run['failed']}, "
            f"client CPU {run['client_cpu_share_of_a_core']:.0%} of a core"
        )
    result = {
        **header("api_throughput", host_info()),
        "workload": {
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "step_ms": args.step_ms,
            "streamed": not args.unstreamed,
        },
        "runs": runs,
    }
    write_result(args.result_file, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
