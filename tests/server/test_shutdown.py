"""SIGTERM: admission stops, in-flight streams end with finish_reason "abort", exit status 0."""

import json
import signal
import threading
import time

import httpx

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
