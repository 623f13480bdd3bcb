"""This machine's floor for admitting a burst: how long the load client takes to deliver
serving_throughput.py's requests, all sent at once, to a server that does nothing with them.

`serving_throughput.py` sends its whole workload at once and compares the served run with
offline `LLM.generate`, which has every request at its first step. A served run cannot
start its last request before that request has reached the server, however cheap the
server is. Here the server is a bare ASGI app on uvicorn (as `octavo serve` runs it): it
reads each body, notes when it arrived, and answers a constant completion whose usage counts
the request's max_tokens. Reported per run, from the client's first send: when the first and
the last request arrived, when the client had every response, and the client's CPU.

    .venv/bin/python -m benchmarks.burst_floor --preset gpu-speed --repeats 3

Speed is never asserted in tests; tests/benchmarks runs a tiny configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks import serving_throughput
from benchmarks.provenance import REPO_ROOT, header, host_info, write_result
from benchmarks.sse_client import free_port, run_clients, running_server

ARRIVALS_PATH = "/arrivals"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(serving_throughput.PRESETS), default="gpu-speed")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="the preset's unless given")  # fmt: skip
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", type=Path, default=None)
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def serve(port: int) -> None:
    """The bare server: POST notes its arrival (after its body) and answers; GET
    ARRIVALS_PATH returns the arrival times (time.time()) since the last such GET."""
    import uvicorn

    arrivals: list[float] = []

    async def respond(send, body: bytes) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    async def app(scope, receive, send) -> None:  # an ASGI 3 application
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        if scope["method"] == "GET":
            body = json.dumps(arrivals if scope["path"] == ARRIVALS_PATH else {}).encode()
            if scope["path"] == ARRIVALS_PATH:
                arrivals.clear()
            await respond(send, body)
            return
        arrivals.append(time.time())
        tokens = json.loads(b"".join(chunks))["max_tokens"]
        usage = {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}
        completion = {"object": "text_completion", "choices": [], "usage": usage}
        await respond(send, json.dumps(completion, separators=(",", ":")).encode())

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", limit_concurrency=8192)


def arrivals(port: int) -> list[float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{ARRIVALS_PATH}", timeout=10) as reply:
        return json.loads(reply.read())


def measure(port: int, bodies: list[bytes], client_procs: int) -> dict:
    """One burst: when (ms after the client's first send) the first and last request
    arrived, when the client had every response, and the client's CPU."""
    arrivals(port)  # forget the warm-up's
    result = run_clients(port, bodies, client_procs)
    times = arrivals(port)
    if len(times) != len(bodies) or result["failed"]:
        raise RuntimeError(f"{len(times)} of {len(bodies)} arrived, {result['failed']} failed")
    return {
        "first_arrival_ms": (min(times) - result["began"]) * 1e3,
        "last_arrival_ms": (max(times) - result["began"]) * 1e3,
        "client_wall_ms": result["wall_s"] * 1e3,
        "client_cpu_ms": result["client_cpu_s"] * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    workload = serving_throughput.parse_args(
        ["--preset", args.preset, "--seed", str(args.seed)]
        + ([] if args.num_requests is None else ["--num-requests", str(args.num_requests)])
    )
    with tempfile.TemporaryDirectory() as tmp:  # the served model's vocabulary: same bodies
        vocab = serving_throughput.write_model(Path(tmp), workload)
    bodies = serving_throughput.bodies(
        serving_throughput.make_requests(workload, vocab), stream=False
    )
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.burst_floor", "--serve", str(port)]
    with running_server(cmd, port, cwd=REPO_ROOT):
        run_clients(port, bodies[:2], 1)  # warm-up
        runs = [measure(port, bodies, args.client_procs) for _ in range(args.repeats)]
    for run in runs:
        print(
            f"first request {run['first_arrival_ms']:.1f} ms, last {run['last_arrival_ms']:.1f} "
            f"ms, every response {run['client_wall_ms']:.1f} ms, client CPU "
            f"{run['client_cpu_ms']:.0f} ms"
        )
    result = {
        **header("burst_floor", host_info()),
        "workload": {"preset": args.preset, "num_requests": len(bodies),
                     "client_procs": args.client_procs},
        "runs": runs,
    }  # fmt: skip
    write_result(args.result_file, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
