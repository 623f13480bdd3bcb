"""SIGTERM: admission stops, in-flight streams end with finish_reason "abort", exit status 0."""

import json
import signal
import socket
import threading
import time

import httpx

from octavo.engine.async_engine import ABORT_DRAIN_SECONDS
from tests.server.conftest import MODEL_NAME, live_server

NUM_STREAMS = 3


def test_sigterm_aborts_in_flight_streams_and_exits_cleanly(tiny_model_dir, tmp_path):
    body = {
        "model": MODEL_NAME,
        "prompt": "Hello",
        "max_tokens": 250,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    # One sequence at a time: the first stream runs, the others wait, so when the grace
    # period ends at least the waiting ones are still in flight and must be aborted.
    with live_server(
        tiny_model_dir, tmp_path, "--shutdown-grace-seconds", "0.2", "--max-num-seqs", "1"
    ) as server:
        streams: list[list[str]] = [[] for _ in range(NUM_STREAMS)]
        started = threading.Event()

        def consume(events: list[str]) -> None:
            with httpx.stream(
                "POST", f"{server.base_url}/v1/completions", json=body, timeout=60
            ) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        started.set()

        readers = [threading.Thread(target=consume, args=(s,)) for s in streams]
        for reader in readers:
            reader.start()
        assert started.wait(30)
        deadline = time.monotonic() + 30
        while server.metrics()["octavo:num_requests_waiting"] < NUM_STREAMS - 1:
            assert time.monotonic() < deadline, "the other requests never arrived"
            time.sleep(0.01)
        server.process.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(30)
            assert not reader.is_alive()
        assert server.process.wait(timeout=30) == 0
    reasons = []
    for events in streams:
        assert events[-1] == "data: [DONE]"
        reasons.append(json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"])
    assert set(reasons) <= {"abort", "length"} and "abort" in reasons


def test_sigterm_ends_the_process_while_a_stream_is_never_read(tiny_model_dir, tmp_path):
    """A client that opens a stream and stops reading cannot hold the shutdown: after the
    grace period, the abort drain and uvicorn's graceful-shutdown timeout the process exits."""
    # 16 samples x 250 tokens with 20 logprobs each: megabytes of events, more than the
    # socket buffers hold, so the server's writes block on the reader that never reads.
    body = {
        "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 250, "temperature": 1.0,
        "ignore_eos": True, "stream": True, "n": 16, "logprobs": 20,
    }  # fmt: skip
    with live_server(tiny_model_dir, tmp_path, "--shutdown-grace-seconds", "0.5") as server:
        host, port = server.base_url.removeprefix("http://").split(":")
        payload = json.dumps(body).encode()
        request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(request)
            assert sock.recv(64).startswith(b"HTTP/1.1 200")  # then never read again
            time.sleep(2)  # the engine generates; the server's writes back up
            sent = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            status = server.process.wait(timeout=30)
            elapsed = time.monotonic() - sent
    assert status == 0
    assert elapsed < 0.5 + ABORT_DRAIN_SECONDS + 5, elapsed
