"""SIGTERM: admission stops, in-flight streams end with finish_reason "abort", exit status 0."""

import json
import signal
import threading

import httpx

from tests.server.conftest import MODEL_NAME, live_server


def test_sigterm_aborts_in_flight_streams_and_exits_cleanly(tiny_model_dir, tmp_path):
    body = {
        "model": MODEL_NAME,
        "prompt": "Hello",
        "max_tokens": 250,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with live_server(
        tiny_model_dir,
        tmp_path,
        "--shutdown-grace-seconds",
        "0.2",
        "--max-num-batched-tokens",
        "16",
    ) as server:
        events: list[str] = []
        started = threading.Event()

        def consume() -> None:
            with httpx.stream(
                "POST", f"{server.base_url}/v1/completions", json=body, timeout=60
            ) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        started.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert started.wait(30)
        server.process.send_signal(signal.SIGTERM)
        reader.join(30)
        assert not reader.is_alive()
        assert server.process.wait(timeout=30) == 0
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort"
    generated = "".join(
        json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-1]
    )
    assert len(generated) > 0
