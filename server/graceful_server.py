"""`GracefulServer`: the uvicorn server of `octavo serve`, which drains the engine on a stop
signal and stops when the engine core dies."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn

from octavo.engine.core.core_process import SERVER_STOP_SIGNALS
from octavo.engine.frontend.async_engine import AsyncEngine


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains on SIGTERM or SIGINT, whether sent to this process alone
    or to its whole process group (systemd's KillMode=control-group, Ctrl-C; the engine core
    ignores both): admission stops, in-flight requests get `grace_seconds` to finish, the rest
    end with finish_reason "abort" (a stream still gets its finish event and [DONE]), the core
    is told to stop, and `run` returns, which `octavo serve` turns into status 0. A second
    signal ends the grace at once. A core that dies on its own stops the server too, with
    `engine_failed` set (status 1)."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncEngine,
        grace_seconds: float,
        stop_signals: tuple[int, ...] = SERVER_STOP_SIGNALS,
    ):
        """`stop_signals`: what drains the server (an API process of several drains on
        what its supervisor forwards, see api_servers.py)."""
        super().__init__(config)
        self.engine = engine
        self.grace_seconds = grace_seconds
        self.stop_signals = stop_signals
        self.engine_failed = False
        engine.on_fatal(self._engine_died)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """`handle_exit` on the stop signals while serving (signals reach the main thread
        only; elsewhere, as in a Ray replica, there is nothing to install)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in self.stop_signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _engine_died(self, exc: BaseException) -> None:
        """A step failed: every in-flight request already has its error; stop serving (a
        live process answering 503 forever helps nobody) and exit non-zero."""
        self.engine_failed = True
        self.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's serve, then the engine's shutdown if the lifespan did not run it (uvicorn
        skips it when the startup fails): a core left running would keep this process from
        exiting, as multiprocessing ends its children at exit with a SIGTERM, which the core
        ignores, and then waits for them."""
        try:
            await super().serve(sockets)
        finally:
            await self.engine.shutdown(0.0)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM and SIGINT while serving: starts the engine's drain and uvicorn's shutdown
        (which waits for the streams to end, then runs the lifespan's `engine.shutdown`, the
        same drain); a repeated signal ends the grace at once.

        uvicorn's own handler is not called. It records the signal to raise it again once the
        server has shut down, so a drained server would die of it (SIGINT: asyncio's
        KeyboardInterrupt traceback) instead of exiting 0; and on a second Ctrl-C it stops
        waiting for open streams and skips the lifespan's shutdown instead of ending the
        grace."""
        grace = 0.0 if self.should_exit else self.grace_seconds
        self.should_exit = True
        # Installed only while `serve` runs on the loop, so the handler runs on its thread;
        # the drain is a task, started once the interrupted callback has returned.
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(self.engine.shutdown(grace)))
