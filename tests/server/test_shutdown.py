"""SIGTERM and SIGINT, to the server alone or to its whole process group (systemd, Ctrl-C):
admission stops, in-flight requests finish within the grace or end with finish_reason "abort",
the engine core stops when told to, and the server exits 0."""

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from octavo.engine.frontend.async_engine import ABORT_DRAIN_SECONDS
from octavo.server.server_args import DEFAULT_MODEL_NAME
from tests.server.conftest import (
    MODEL_NAME,
    STREAM_TIMEOUT_S,
    LiveServer,
    StreamReader,
    core_pid,
    live_server,
)

pytestmark = pytest.mark.slow

# Streams of 250 tokens, one sequence at a time: more than the 0.2 s grace period drains
# at the tiny model's speed (a fraction of a millisecond a step), so some are aborted.
NUM_STREAMS = 8


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


# The stop-signal tests serve the embedded default model. Both margins are wide on a 2-core
# CPU: the short stream's last tokens come ~0.1 s after the signal, well within the grace; the
# long stream, many choices of many tokens, would take ~10 s, well past it.
GRACE_S = 1.5
SHORT_TOKENS = 16
LONG_TOKENS = 500  # the default model's context is 512 tokens
LONG_CHOICES = 32
NUM_BLOCKS = "4096"  # the long stream's choices never wait for blocks (no preemption)
STOP_TEST_TIMEOUT_S = 120
# A grace no test waits out: only a second signal can end it.
ENDLESS_GRACE_S = 3600
HEALTH_POLL_S = 0.01


def wait_until_draining(server: LiveServer) -> None:
    """Returns once the server no longer answers /health with 200 (it stopped admitting or
    closed its socket): its drain has begun."""
    deadline = time.monotonic() + STREAM_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{server.base_url}/health", timeout=STREAM_TIMEOUT_S).status_code != 200:
                return
        except httpx.TransportError:
            return
        time.sleep(HEALTH_POLL_S)
    raise AssertionError("the server kept serving after the signal")


def assert_clean_exit(server: LiveServer, status: int, core: int) -> None:
    """Exit 0, no traceback in the log, and the engine core gone with the server."""
    log = Path(server.log_path).read_text()
    assert status == 0, log
    assert "Traceback" not in log, log
    assert not Path(f"/proc/{core}").exists(), "the engine core outlived the server"


def stream_body(max_tokens: int, **extra) -> dict:
    return {
        "model": DEFAULT_MODEL_NAME, "prompt": "Hello", "max_tokens": max_tokens,
        "ignore_eos": True, "stream": True, **extra,
    }  # fmt: skip


@pytest.mark.timeout(STOP_TEST_TIMEOUT_S)
@pytest.mark.parametrize("to_group", [True, False], ids=["process-group", "main-process"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_drains_in_flight_streams_and_exits_0(signum, to_group, tmp_path):
    """systemd (SIGTERM) and Ctrl-C (SIGINT) signal the engine core too; `kill` signals the
    server alone. Either way the stream that can finish within the grace does, the other one
    ends with "abort" on every choice, both end with [DONE], the core stops when the server
    tells it to (not of the signal), and the server exits 0 with no traceback."""
    grace = ["--shutdown-grace-seconds", str(GRACE_S), "--num-blocks", NUM_BLOCKS]
    with live_server(None, tmp_path, *grace, new_session=True) as server:
        core = core_pid(server.process.pid)
        long = StreamReader(
            server.base_url, stream_body(LONG_TOKENS, n=LONG_CHOICES, temperature=1.0)
        )
        short = StreamReader(
            server.base_url,
            stream_body(SHORT_TOKENS, temperature=0, stream_options={"include_usage": True}),
        )
        for reader in (long, short):  # the short one starts last: it is in flight for sure
            reader.start()
            assert reader.started.wait(STREAM_TIMEOUT_S)
        if to_group:
            os.killpg(server.process.pid, signum)
        else:
            server.process.send_signal(signum)
        for reader in (long, short):
            reader.join(STREAM_TIMEOUT_S)
            assert not reader.is_alive()
        status = server.process.wait(timeout=STREAM_TIMEOUT_S)
    assert_clean_exit(server, status, core)

    assert short.status == 200 and short.lines[-1] == "data: [DONE]"
    *choices, usage = short.chunks()
    assert choices[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens"] == SHORT_TOKENS

    assert long.status == 200 and long.lines[-1] == "data: [DONE]"
    chunks = long.chunks()
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    finished = {
        choice["index"]: choice["finish_reason"]
        for chunk in chunks
        for choice in chunk["choices"]
        if choice["finish_reason"] is not None
    }
    assert finished == dict.fromkeys(range(LONG_CHOICES), "abort")


@pytest.mark.timeout(STOP_TEST_TIMEOUT_S)
def test_a_second_ctrl_c_ends_the_grace_at_once(tmp_path):
    """Ctrl-C twice in the terminal: the second one aborts what the first one's grace would
    have waited for, and the server still exits 0 with every stream ended properly."""
    grace = ["--shutdown-grace-seconds", str(ENDLESS_GRACE_S), "--num-blocks", NUM_BLOCKS]
    with live_server(None, tmp_path, *grace, new_session=True) as server:
        core = core_pid(server.process.pid)
        long = StreamReader(
            server.base_url, stream_body(LONG_TOKENS, n=LONG_CHOICES, temperature=1.0)
        )
        long.start()
        assert long.started.wait(STREAM_TIMEOUT_S)
        os.killpg(server.process.pid, signal.SIGINT)
        wait_until_draining(server)
        os.killpg(server.process.pid, signal.SIGINT)
        long.join(STREAM_TIMEOUT_S)
        assert not long.is_alive()
        status = server.process.wait(timeout=STREAM_TIMEOUT_S)
    assert_clean_exit(server, status, core)
    assert long.status == 200 and long.lines[-1] == "data: [DONE]"
    assert long.chunks()[-1]["choices"][0]["finish_reason"] == "abort"
