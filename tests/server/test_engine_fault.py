"""A step that fails ends the server: every request in flight gets an OpenAI-shaped 503 (a
stream an error event, then [DONE]), the server stops instead of answering 503 forever, and
`octavo serve` would exit 1."""

import asyncio
import json
import threading

import httpx
import pytest
import uvicorn

from octavo.engine import EngineConfig
from octavo.engine.frontend.async_engine import AsyncEngine
from octavo.server.app import create_app
from octavo.server.graceful_server import GracefulServer
from octavo.server.serving_engine import ServerConfig
from tests.server.conftest import free_port

pytestmark = pytest.mark.slow

SERVE_TIMEOUT_S = 60
FAULT = "injected step fault"


def assert_engine_died(body: dict) -> None:
    """The error a request in flight when the core died gets (serving_engine.engine_error
    of the EngineStoppedError that AsyncEngine puts on every open stream)."""
    error = body["error"]
    assert error["type"] == "service_unavailable_error", error
    assert error["message"].startswith("the engine core died: ") and FAULT in error["message"]
    assert error["param"] is None and error["code"] is None


def test_a_step_fault_answers_the_request_and_stops_the_server(tiny_model_dir):
    engine = AsyncEngine.in_process(
        EngineConfig(model=tiny_model_dir, device="cpu", num_blocks=64), 8
    )
    both_submitted = threading.Event()

    def broken_step(output):
        # The first step holds until both requests below are queued, so both are in flight
        # (a stream already answered 200) when it fails; neither has a token yet.
        both_submitted.wait(SERVE_TIMEOUT_S)
        raise RuntimeError(FAULT)

    engine.client.core.step_observers.append(broken_step)
    port = free_port()
    app = create_app(engine, ServerConfig(served_model_name="tiny", shutdown_grace_seconds=1))
    server = GracefulServer(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"), engine, 1.0
    )

    async def main():
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}
            requests = asyncio.gather(
                client.post("/v1/completions", json=body),
                client.post("/v1/completions", json=body | {"stream": True}),
            )
            while engine.num_waiting < 2:  # both sent to the core, which is in its step
                await asyncio.sleep(0.01)
            both_submitted.set()
            plain, streamed = await requests
        await asyncio.wait_for(serving, timeout=SERVE_TIMEOUT_S)
        return plain, streamed

    plain, streamed = asyncio.run(main())
    assert plain.status_code == 503, plain.text
    assert_engine_died(plain.json())
    # The stream was answered (200) when it was queued: it ends with one error event and
    # [DONE], never cut off.
    assert streamed.status_code == 200, streamed.text
    error_event, done, end = streamed.text.split("\n\n")
    assert done == "data: [DONE]" and end == ""
    assert_engine_died(json.loads(error_event.removeprefix("data: ")))
    assert server.engine_failed
