"""A load client light enough not to be the bottleneck: raw sockets, no JSON but the usage.

Sends prebuilt completion requests all at once from separate processes (stdlib only, so a
spawned client starts in milliseconds), reads each response to the end, counts its SSE
events (a stream) or checks its status (a plain JSON response), and parses only the usage
for the token count. Each process reports its
CPU time, so a caller can tell whether the clients could have limited the figure.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

# Client processes start this long before their first request, so that all are ready.
START_DELAY_S = 1.0
SERVER_STARTUP_TIMEOUT_S = 120
SERVER_EXIT_TIMEOUT_S = 30
# Seconds between /health requests while a server starts.
HEALTH_POLL_S = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(
    cmd: list[str], port: int, poll_s: float = HEALTH_POLL_S, **popen: object
) -> Iterator[subprocess.Popen]:
    """Starts a server process, yields it once /health answers on `port` (asked every
    `poll_s`), and stops it (SIGTERM, then kill) however the block ends."""
    server = subprocess.Popen(cmd, **popen)  # type: ignore[call-overload]
    try:
        deadline = time.monotonic() + SERVER_STARTUP_TIMEOUT_S
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not start") from None
                time.sleep(poll_s)
        yield server
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(SERVER_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()


async def stream_one(port: int, body: bytes) -> tuple[int, bool, int, float, int]:
    """One completion: (completion tokens from the usage, whether it succeeded (a stream:
    ended with [DONE] and no error; else status 200), the number of events (0 unstreamed),
    seconds to the first event or the response, prompt tokens found in the prefix cache)."""
    sent = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    data = b""
    while b"\r\n\r\n" not in data or (b"event-stream" in data and b"data: " not in data):
        chunk = await reader.read(1 << 16)  # the head, then a stream's first event
        if not chunk:
            break
        data += chunk
    ttft = time.perf_counter() - sent
    data += await reader.read()  # until the server closes: the whole body
    writer.close()
    head = data[: data.find(b"\r\n\r\n")]
    if b"text/event-stream" in head:
        done = b"data: [DONE]" in data and b'data: {"error"' not in data
    else:
        done = head.startswith(b"HTTP/1.1 200")
    events = data.count(b"data: ")
    usage_at = data.rfind(b'"usage":{')
    if usage_at < 0:
        return 0, False, events, ttft, 0
    usage = json.JSONDecoder().raw_decode(data[usage_at + 8 :].decode())[0]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return usage["completion_tokens"], done, events, ttft, cached


def _client_process(
    port: int, bodies: list[bytes], start_at: float, cpus: set[int] | None
) -> tuple[list, float, float, float]:
    """One client process's work: (outcomes, its CPU seconds, first send, last read)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)

    async def main():
        while time.time() < start_at:
            await asyncio.sleep(0.001)
        began = time.time()
        return began, await asyncio.gather(*(stream_one(port, b) for b in bodies))

    cpu = time.process_time()
    began, outcomes = asyncio.run(main())
    return outcomes, time.process_time() - cpu, began, time.time()


def run_clients(
    port: int, bodies: list[bytes], num_procs: int = 1, cpus: set[int] | None = None
) -> dict:
    """Sends every body at once from `num_procs` processes (pinned to `cpus` if given).
    Wall time runs from the first request sent to the last response read."""
    start_at = time.time() + START_DELAY_S
    shares = [bodies[i::num_procs] for i in range(num_procs)]
    # Each client runs this file as a script: multiprocessing's spawn would first re-import
    # the caller's main module (a benchmark script that imports torch: seconds per client).
    procs = [
        subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for _ in shares
    ]
    for proc, share in zip(procs, shares, strict=True):
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps((port, share, start_at, cpus)))
        proc.stdin.close()
    gathered = []
    for proc in procs:
        assert proc.stdout is not None
        out = proc.stdout.read()
        if proc.wait() != 0:
            raise RuntimeError(f"a load client exited with {proc.returncode}")
        gathered.append(pickle.loads(out))
    began = min(g[2] for g in gathered)
    wall = max(g[3] for g in gathered) - began
    outcomes = [o for g in gathered for o in g[0]]
    tokens = sum(o[0] for o in outcomes)
    client_cpu = sum(g[1] for g in gathered)
    return {
        "began": began,  # time.time() of the first request sent
        "wall_s": wall,
        "completion_tokens": tokens,
        "events": sum(o[2] for o in outcomes),
        "failed": sum(not o[1] for o in outcomes),
        "tokens_per_s": tokens / wall,
        "ttft_median_s": statistics.median(o[3] for o in outcomes),
        # Streamed, the last stream's first event: when a burst's last request had been
        # admitted and had its first step.
        "ttft_max_s": max(o[3] for o in outcomes),
        "cached_prompt_tokens": sum(o[4] for o in outcomes),
        "client_cpu_s": client_cpu,
        "client_cpu_share_of_a_core": client_cpu / wall,
    }


if __name__ == "__main__":  # a client process of run_clients: arguments in, results out
    sys.stdout.buffer.write(pickle.dumps(_client_process(*pickle.loads(sys.stdin.buffer.read()))))
