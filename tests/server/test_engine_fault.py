"""A step that fails ends the server (issue 11): the in-flight request gets an OpenAI-shaped
error, the server stops instead of answering 503 forever, and `octavo serve` would exit 1."""

import asyncio
import time

import httpx
import uvicorn

from octavo.engine import EngineConfig
from octavo.engine.async_engine import AsyncEngine
from octavo.server.app import create_app
from octavo.server.cli import GracefulServer
from octavo.server.serving_engine import ServerConfig
from tests.server.conftest import free_port

SERVE_TIMEOUT_S = 60
STEP_DELAY_S = 0.5


def test_a_step_fault_answers_the_request_and_stops_the_server(tiny_model_dir):
    engine = AsyncEngine.in_process(
        EngineConfig(model=tiny_model_dir, device="cpu", num_blocks=64), 8
    )

    def broken_step(output):
        time.sleep(STEP_DELAY_S)  # both requests below are in flight when the step fails
        raise RuntimeError("injected step fault")

    engine.client.core.runner.execute_async = broken_step
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
            plain, streamed = await asyncio.gather(
                client.post("/v1/completions", json=body),
                client.post("/v1/completions", json=body | {"stream": True}),
            )
        await asyncio.wait_for(serving, timeout=SERVE_TIMEOUT_S)
        return plain, streamed

    plain, streamed = asyncio.run(main())
    assert plain.status_code == 503, plain.text
    assert "injected step fault" in plain.json()["error"]["message"]
    # The stream ended with an error event (or was refused if the engine was already dead).
    if streamed.status_code == 200:
        assert '"error"' in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
    else:
        assert streamed.status_code == 503
    assert server.engine_failed
