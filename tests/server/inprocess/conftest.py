"""The app of `octavo serve` driven in-process: `create_app` over an `AsyncEngine` whose core
runs in a thread, called through httpx's ASGITransport (no socket, no subprocess), so these
tests are in `make test-fast`. What needs a real socket (disconnects, signals, header
timeouts, several processes) stays with the live servers of tests/server/.

The app and its engine live on an event loop in a thread of their own, for the session: a
test calls the sync `http` client or the official `openai` client (both carried to that loop
by `LoopTransport`), or runs a coroutine there with `run`. ASGITransport runs no lifespan
events, so `InProcessServer` sends the app's lifespan startup and shutdown itself: the app's
own lifespan starts and drains the engine, as under uvicorn."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import openai
import pytest

from octavo.engine import EngineConfig
from octavo.engine.frontend.async_engine import AsyncEngine
from octavo.server.app import create_app
from octavo.server.chat_template import load_chat_template
from octavo.server.serving_engine import ServerConfig
from tests.server.conftest import CHAT_TEMPLATE, MODEL_NAME, TOOL_CHAT_TEMPLATE

T = TypeVar("T")
BASE_URL = "http://octavo.test"
CALL_TIMEOUT_S = 60
# As the live `server` fixture's flags: 1024 blocks of 8, 64 sequences, 512-token steps.
ENGINE_ARGS = {"num_blocks": 1024, "block_size": 8, "max_num_seqs": 64}
ENGINE_ARGS |= {"max_num_batched_tokens": 512}
MAX_NUM_WAITING = 1024  # octavo serve's default


class LoopTransport(httpx.BaseTransport):
    """A sync httpx transport that sends each request through an AsyncClient on another
    thread's event loop (where the app and its engine live) and waits for the whole
    response."""

    def __init__(self, client: httpx.AsyncClient, loop: asyncio.AbstractEventLoop):
        self.client = client
        self.loop = loop

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()

        async def send() -> tuple[int, httpx.Headers, bytes]:
            forwarded = httpx.Request(
                request.method, request.url, headers=request.headers, content=body
            )
            response = await self.client.send(forwarded)
            return response.status_code, response.headers, await response.aread()

        future = asyncio.run_coroutine_threadsafe(send(), self.loop)
        status, headers, content = future.result(CALL_TIMEOUT_S)
        return httpx.Response(status, headers=headers, content=content, request=request)


class InProcessServer:
    """One app with its engine on a loop thread; `close` runs the app's lifespan shutdown.
    `engine_args` change ENGINE_ARGS (the engine flags of `octavo serve`, as --stream-interval),
    `max_num_waiting_per_user` is the flag's, `server_config` the ServerConfig."""

    def __init__(
        self,
        model_dir: str,
        engine_args: dict[str, Any] | None = None,
        max_num_waiting_per_user: int | None = None,
        **server_config: Any,
    ):
        self.model_dir = model_dir
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        engine_config = EngineConfig(
            model=model_dir, device="cpu", dtype="float32", **(ENGINE_ARGS | (engine_args or {}))
        )
        self.engine = AsyncEngine.in_process(
            engine_config, MAX_NUM_WAITING, max_num_waiting_per_user
        )
        config = {
            "served_model_name": MODEL_NAME,
            "model_root": model_dir,
            "shutdown_grace_seconds": 1.0,
            "max_n": ENGINE_ARGS["max_num_seqs"] // 4,  # octavo serve's default share
            "chat_template": load_chat_template(CHAT_TEMPLATE, model_dir, "auto"),
        } | server_config
        self.app = create_app(self.engine, ServerConfig(**config))
        self._lifespan: asyncio.Queue[dict] | None = None
        self._lifespan_task: asyncio.Task | None = None
        self.run(self._start())
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url=BASE_URL
        )
        self.http = httpx.Client(transport=LoopTransport(self.client, self.loop), base_url=BASE_URL)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs a coroutine on the app's loop (where `client` may be used) and returns its
        result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(CALL_TIMEOUT_S)

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        """The official openai client, without retries, on this app."""
        return openai.OpenAI(
            base_url=f"{BASE_URL}/v1", api_key=api_key, max_retries=0, http_client=self.http
        )

    def metrics(self) -> dict[str, float]:
        """The octavo:* samples of /metrics (histogram buckets excluded)."""
        values = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith("octavo:") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    async def _start(self) -> None:
        """The ASGI lifespan startup (what uvicorn sends first): the app starts its engine."""
        self._lifespan = asyncio.Queue()
        sent: asyncio.Queue[dict] = asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self._sent = sent
        self._lifespan_task = asyncio.create_task(
            self.app(scope, self._lifespan.get, sent.put)  # type: ignore[arg-type]
        )
        await self._lifespan.put({"type": "lifespan.startup"})
        message = await sent.get()
        assert message["type"] == "lifespan.startup.complete", message

    async def _stop(self) -> None:
        assert self._lifespan is not None and self._lifespan_task is not None
        await self.client.aclose()
        await self._lifespan.put({"type": "lifespan.shutdown"})
        message = await self._sent.get()
        assert message["type"] == "lifespan.shutdown.complete", message
        await self._lifespan_task

    def close(self) -> None:
        self.http.close()
        try:
            self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(CALL_TIMEOUT_S)
            self.loop.close()


@pytest.fixture(scope="session")
def app_server(tiny_model_dir) -> Iterator[InProcessServer]:
    """The tiny model served in-process, shared by the session (as the live `server`)."""
    server = InProcessServer(tiny_model_dir)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def http(app_server) -> httpx.Client:
    """A sync httpx client of the in-process app (paths relative to its root)."""
    return app_server.http


@pytest.fixture(scope="session")
def client(app_server) -> openai.OpenAI:
    """The official openai client of the in-process app."""
    return app_server.openai()


@pytest.fixture(scope="session")
def tools_server(tiny_model_dir) -> Iterator[InProcessServer]:
    """The tiny model served with a tool-aware template and tool_choice "auto" on (the
    hermes parser), shared by the tool-calling and Responses tests."""
    server = InProcessServer(
        tiny_model_dir,
        chat_template=load_chat_template(TOOL_CHAT_TEMPLATE, tiny_model_dir, "auto"),
        tool_call_parser="hermes",
    )
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def tools_client(tools_server) -> openai.OpenAI:
    return tools_server.openai()
