"""`octavo serve` runs the engine core in its own process: killing it (-9) under load ends
every in-flight stream with an error event and the server exits non-zero within seconds."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from octavo.engine.config import EngineConfig
from octavo.engine.frontend.core_client import MultiprocessCoreClient
from tests.server.conftest import MODEL_NAME, core_pid, live_server

pytestmark = pytest.mark.slow

NUM_STREAMS = 4
EXIT_TIMEOUT_S = 15


def test_killing_the_core_ends_every_stream_with_an_error_and_the_server_exits_1(
    tiny_model_dir, tmp_path
):
    body = {
        "model": MODEL_NAME,
        "prompt": "Hello",
        "max_tokens": 250,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with live_server(tiny_model_dir, tmp_path) as server:
        streams: list[list[str]] = [[] for _ in range(NUM_STREAMS)]
        started = threading.Barrier(NUM_STREAMS + 1)

        def consume(events: list[str]) -> None:
            with httpx.stream(
                "POST", f"{server.base_url}/v1/completions", json=body, timeout=60
            ) as response:
                for line in response.iter_lines():
                    if line:
                        if not events:
                            started.wait(30)
                        events.append(line)

        readers = [threading.Thread(target=consume, args=(s,)) for s in streams]
        for reader in readers:
            reader.start()
        started.wait(30)  # every stream has received tokens
        os.kill(core_pid(server.process.pid), signal.SIGKILL)
        for reader in readers:
            reader.join(EXIT_TIMEOUT_S)
            assert not reader.is_alive()
        assert server.process.wait(timeout=EXIT_TIMEOUT_S) == 1
    log = Path(server.log_path).read_text()
    assert "engine core process exited with status -9" in log
    for events in streams:
        assert events[-1] == "data: [DONE]"
        # The error of a request in flight when the core died (a 503's body), then [DONE].
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable_error", error
        assert error["message"] == (
            "the engine core died: the engine core process exited with status -9"
        )


def test_a_process_that_exits_without_closing_its_core_client_still_exits(tiny_model_dir):
    """The core ignores SIGTERM, so multiprocessing's exit hook alone (terminate, then join)
    would wait for it forever: the client closes its core at exit instead."""
    script = (
        "import sys\n"
        "from octavo.engine.config import EngineConfig\n"
        "from octavo.engine.frontend.core_client import MultiprocessCoreClient\n"
        "config = EngineConfig(model=sys.argv[1], device='cpu', num_blocks=64)\n"
        "client = MultiprocessCoreClient(config, 1)\n"
        "print(client.process.pid, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, tiny_model_dir],
        capture_output=True,
        text=True,
        timeout=EXIT_TIMEOUT_S * 4,
    )
    assert done.returncode == 0, done.stderr
    core = int(done.stdout.split()[0])
    assert not Path(f"/proc/{core}").exists()  # exited and reaped by its parent


def test_closing_the_client_reaps_the_core_once_without_a_false_alarm(tiny_model_dir, caplog):
    """The receiver thread sees the core's exit while `close` waits for it: only `close`
    reaps it. Two reapers raced, and the loser found a core that had exited "still alive",
    logged that it did not exit and killed its reaped pid (3 closes in 25 here)."""
    config = EngineConfig(model=tiny_model_dir, device="cpu", num_blocks=64)
    client = MultiprocessCoreClient(config, 1)
    loop = asyncio.new_event_loop()
    deaths: list[BaseException] = []
    client.start(loop, lambda outputs: None, deaths.append)
    process = client.process
    assert process is not None
    joined_by: list[str] = []
    join = process.join

    def recorded_join(timeout: float | None = None) -> None:
        joined_by.append(threading.current_thread().name)
        join(timeout)

    process.join = recorded_join  # type: ignore[method-assign]
    try:
        client.close()
    finally:
        loop.close()
    assert set(joined_by) == {threading.current_thread().name}
    assert process.exitcode == 0
    assert "did not exit" not in caplog.text
    assert not deaths  # a requested exit is no death


def loaded_libraries(pid: int) -> str:
    """The shared objects process `pid` has mapped (Linux)."""
    return Path(f"/proc/{pid}/maps").read_text()


def test_only_the_engine_core_loads_torch(server, client):
    """The API process runs no model: after completions, a stream and a chat request (every
    lazy import of the request paths done), it has not loaded torch, which would cost every
    start seconds before the core even spawns. The core, which runs the model, has."""
    client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, logprobs=2)
    for _ in client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3, stream=True):
        pass
    client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert "libtorch" in loaded_libraries(core_pid(server.process.pid))
    assert "libtorch" not in loaded_libraries(server.process.pid)
