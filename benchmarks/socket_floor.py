"""This machine's floor for a streamed event: the CPU one server process spends to send one
event on each of N open connections per step, with no Octavo code in the process.

The API process of `octavo serve` sends one SSE event per stream per engine step when the
engine is as fast as a GPU makes it (one token each). Whatever this floor is, no server on
this machine sends an event for less. Three servers, each one layer more than the last:

  write   one task writes each step's event to every connection's uvloop transport in a
          loop: the syscall per event and the least Python around it;
  tasks   one asyncio task per connection, woken by a future each step, writes its event:
          adds the wake-up and task switch every stream of a server pays;
  asgi    uvicorn with httptools (as `octavo serve` runs it) and a bare ASGI app whose
          handler per request awaits its future and sends its event as a response body
          chunk: adds the HTTP framework, without Starlette, FastAPI or Octavo.

The server runs pinned to CPU 0; the client, in its own process on the other CPUs, opens the
connections and reads every byte (it parses nothing). Steps come every --step-ms at most,
so the client keeps up and each event is a write of its own, as one token per event is.
Reported: the server's CPU per event, from its first step to its last write.

    .venv/bin/python benchmarks/socket_floor.py --streams 256 --steps 200 --step-ms 20

Speed is never asserted in tests; tests/benchmarks runs a tiny configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

try:
    import octavo.benchmarks  # noqa: F401 -- not octavo.engine: nothing here needs torch
except ImportError:  # run as a plain script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uvicorn
import uvloop

from octavo.benchmarks.provenance import header, host_info, write_result

SERVER_CPU = 0
MODES = ("write", "tasks", "asgi")
# An OpenAI completion chunk of one token is about this long on the wire.
EVENT = b"data: " + b"x" * 172 + b"\n\n"
REQUEST = b"GET / HTTP/1.1\r\nHost: floor\r\n\r\n"
# The HTTP server's response head before its first body chunk (asgi mode).
RESPONSE_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream")],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--result-file", type=Path, default=None)
    return parser.parse_args(argv)


class Steps:
    """Each step's wake-up for every stream: stream i awaits `wait(i)`, `release` sets them
    all. `cpu_s` is the server's CPU from the first step to the last event written."""

    def __init__(self, streams: int):
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.futures = [loop.create_future() for _ in range(streams)]
        self.connected = 0
        self.all_connected = loop.create_future()
        self.events_left = 0
        self.done = loop.create_future()
        self.cpu_s = 0.0

    def connect(self) -> None:
        self.connected += 1
        if self.connected == len(self.futures):
            self.all_connected.set_result(None)

    def wait(self, stream: int) -> asyncio.Future:
        return self.futures[stream]

    def release(self) -> None:
        futures, self.futures = self.futures, [self.loop.create_future() for _ in self.futures]
        for future in futures:
            future.set_result(None)

    def sent(self) -> None:
        self.events_left -= 1
        if not self.events_left:
            self.done.set_result(None)


async def run_steps(steps: Steps, args: argparse.Namespace, write_all=None) -> None:
    """Paces the steps; `write_all` writes a step's events itself (write mode), else each
    stream's task writes on its wake-up."""
    await steps.all_connected
    steps.events_left = args.streams * args.steps
    start = time.process_time()
    for _ in range(args.steps):
        began = time.perf_counter()
        if write_all is not None:
            write_all()
        else:
            steps.release()
        await asyncio.sleep(max(0.0, args.step_ms / 1e3 - (time.perf_counter() - began)))
    await steps.done
    steps.cpu_s = time.process_time() - start


async def serve_transports(sock: socket.socket, args: argparse.Namespace, mode: str) -> float:
    """write and tasks modes: a bare protocol that answers each request's bytes by opening
    the stream; returns the server's CPU seconds."""
    steps = Steps(args.streams)
    transports: list[asyncio.Transport] = []

    class Stream(asyncio.Protocol):
        def connection_made(self, transport):  # type: ignore[override]
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            index = len(transports)
            transports.append(self.transport)
            if mode == "tasks":  # scheduled first: it awaits its future before step one
                asyncio.ensure_future(stream_task(index, self.transport))
            steps.connect()

    async def stream_task(index: int, transport: asyncio.Transport) -> None:
        for _ in range(args.steps):
            await steps.wait(index)
            transport.write(EVENT)
            steps.sent()

    def write_all() -> None:
        for transport in transports:
            transport.write(EVENT)
            steps.sent()

    server = await asyncio.get_running_loop().create_server(Stream, sock=sock)
    await run_steps(steps, args, write_all if mode == "write" else None)
    for transport in transports:
        transport.close()
    server.close()
    return steps.cpu_s


async def serve_asgi(sock: socket.socket, args: argparse.Namespace) -> float:
    """asgi mode: uvicorn with httptools and a bare ASGI app streaming each request's
    events; returns the server's CPU seconds."""
    steps = Steps(args.streams)

    async def app(scope, receive, send):  # an ASGI 3 application
        if scope["type"] != "http":
            return
        index = steps.connected
        await send(RESPONSE_START)  # never waits: the future below is taken before step one
        steps.connect()
        for _ in range(args.steps):
            await steps.wait(index)
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
            steps.sent()
        await send({"type": "http.response.body", "body": b""})

    config = uvicorn.Config(app, http="httptools", lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    await run_steps(steps, args)
    server.should_exit = True
    await serving
    return steps.cpu_s


def server_process(sock: socket.socket, args: argparse.Namespace, mode: str, out) -> None:
    os.sched_setaffinity(0, {SERVER_CPU})
    run = serve_asgi(sock, args) if mode == "asgi" else serve_transports(sock, args, mode)
    out.send(uvloop.run(run))


def client_process(port: int, args: argparse.Namespace) -> None:
    """Opens every stream and reads until each has all its events (counted by their
    terminator: every event ends in a blank line, the HTTP head and chunk framing do not)."""
    os.sched_setaffinity(0, (os.sched_getaffinity(0) - {SERVER_CPU}) or {SERVER_CPU})

    async def stream() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        seen = 0
        while seen < args.steps:
            data = await reader.read(1 << 16)
            if not data:
                raise ConnectionError(f"closed after {seen} of {args.steps} events")
            seen += data.count(b"\n\n")
        writer.close()

    async def main() -> None:
        await asyncio.gather(*(stream() for _ in range(args.streams)))

    uvloop.run(main())


def measure(args: argparse.Namespace, mode: str) -> dict:
    """One run of `mode`: the server's CPU seconds, the events it sent and its CPU per
    event in microseconds."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(args.streams)
    context = mp.get_context("fork")  # nothing to re-import; no event loop runs here yet
    result, out = context.Pipe(duplex=False)
    server = context.Process(target=server_process, args=(sock, args, mode, out))
    client = context.Process(target=client_process, args=(sock.getsockname()[1], args))
    server.start()
    client.start()
    client.join()
    cpu_s = result.recv()
    server.join()
    sock.close()
    if client.exitcode or server.exitcode:
        raise RuntimeError(f"{mode}: client exit {client.exitcode}, server {server.exitcode}")
    events = args.streams * args.steps
    return {"cpu_s": cpu_s, "events": events, "us_per_event": cpu_s / events * 1e6}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for _ in range(args.repeats):  # modes alternate, so a slow spell touches them all
        for mode in args.modes:
            runs[mode].append(measure(args, mode))
    result = {
        **header("socket_floor", host_info()),
        "workload": {"streams": args.streams, "steps": args.steps, "step_ms": args.step_ms,
                     "event_bytes": len(EVENT)},
        "runs": runs,
    }  # fmt: skip
    for mode, values in runs.items():
        shown = ", ".join(f"{v['us_per_event']:.1f}" for v in values)
        print(f"{mode:>6}: server CPU per event {shown} us")
    write_result(args.result_file, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
