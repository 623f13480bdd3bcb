"""How the AsyncEngine reaches its engine core: a thread of this process, or its own process.

Both clients carry the same messages (EngineCoreInputs in, EngineCoreOutputs out) and call
back on the event loop, so the front end (input and output processors, streams) is one code
path. `MultiprocessCoreClient` is what `octavo serve` uses: the core steps in a process of
its own and never competes with HTTP for the GIL. `InprocessCoreClient` keeps everything in
one process (tests, debugging, `--inprocess-engine`).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
import queue
import select
import shutil
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq

from octavo.engine.config import EngineConfig
from octavo.engine.core.core_process import CoreAddresses, run_engine_core
from octavo.engine.core_messages import (
    CoreMessage,
    EngineCoreFailed,
    EngineCoreInputs,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineStats,
    ModelLimits,
)

if TYPE_CHECKING:
    from octavo.engine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)

OutputHandler = Callable[[EngineCoreOutputs], None]
DeathHandler = Callable[[BaseException], None]

# Loading a model and sizing its cache takes seconds on CPU; minutes only for a large
# checkpoint fetched from the hub.
CORE_STARTUP_TIMEOUT_S = 600.0
# After `shutdown`, how long the core may take to exit before it is terminated.
CORE_EXIT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class SharedCore:
    """Where API process `client_index` of several finds the engine core that their
    supervisor started (process `core_pid`), and its sockets."""

    addresses: CoreAddresses
    client_index: int
    core_pid: int


class EngineCoreDiedError(RuntimeError):
    """The engine core stopped without being asked to (its loop raised, or its process
    exited); no request in flight can finish."""


class EngineCoreClient(ABC):
    """The front end's handle on a core. `limits` and `initial_stats` are known once the
    constructor returns (the core is up); `start` wires the callbacks, which run on `loop`:
    `on_outputs` for each EngineCoreOutputs, `on_death` once if the core dies."""

    limits: ModelLimits
    initial_stats: EngineStats

    @abstractmethod
    def start(
        self, loop: asyncio.AbstractEventLoop, on_outputs: OutputHandler, on_death: DeathHandler
    ) -> None: ...

    @abstractmethod
    def send(self, inputs: EngineCoreInputs) -> None:
        """Queues inputs for the core without blocking (called on the event loop)."""

    @abstractmethod
    def close(self) -> None:
        """Stops the core (blocking until it has): after the in-flight requests ended."""


class InprocessCoreClient(EngineCoreClient):
    """The core's busy loop in a daemon thread of this process."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.limits = core.limits
        self.initial_stats = core.stats()
        self._inputs: queue.SimpleQueue[EngineCoreInputs] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(
        self, loop: asyncio.AbstractEventLoop, on_outputs: OutputHandler, on_death: DeathHandler
    ) -> None:
        def receive(block: bool) -> EngineCoreInputs | None:
            try:
                return self._inputs.get(block=block)
            except queue.Empty:
                return None

        def send(outputs: EngineCoreOutputs) -> None:
            loop.call_soon_threadsafe(on_outputs, outputs)

        def run() -> None:
            try:
                self.core.run_busy_loop(receive, send)
            except BaseException as exc:  # the loop cannot go on: every stream must hear it
                logger.exception("engine core loop died")
                loop.call_soon_threadsafe(on_death, EngineCoreDiedError(f"{exc!r}"))

        self._thread = threading.Thread(target=run, name="octavo-engine-core", daemon=True)
        self._thread.start()

    def send(self, inputs: EngineCoreInputs) -> None:
        self._inputs.put(inputs)

    def close(self) -> None:
        self._inputs.put(EngineCoreInputs(shutdown=True))
        if self._thread is not None:
            self._thread.join()


class MultiprocessCoreClient(EngineCoreClient):
    """Talks to an engine core in another process over two IPC sockets: one it spawns
    (`octavo serve`), or, with `connect`, one of several API processes' shared core
    (`--api-server-count`), which the supervisor that started them owns.

    Construction returns once the core reports ready, and raises ValueError with the core's
    message if it could not start (a bad model path, say). A receiver thread decodes what
    the core sends and watches the process (its sentinel, or a pidfd for a core this process
    did not start): if it exits unasked (killed, crashed), `on_death` runs at once, not at
    the next timeout.
    """

    def __init__(
        self,
        config: EngineConfig,
        num_threads: int | None,
        target: Callable[[EngineConfig, CoreAddresses, int | None, int], None] = run_engine_core,
    ):
        """Spawns the core. `target` is the process's entry point, `run_engine_core` unless
        a benchmark swaps in a stand-in core that speaks the same messages."""
        self._dir: Path | None = Path(tempfile.mkdtemp(prefix="octavo-core-"))
        addresses = CoreAddresses.in_folder(self._dir, 1)
        self._open(addresses, 0)
        # spawn, not fork: this process already runs threads (torch's, uvicorn's).
        self.process: BaseProcess | None = multiprocessing.get_context("spawn").Process(
            target=target,
            args=(config, addresses, num_threads, os.getpid()),
            name="octavo-engine-core",
            daemon=True,
        )
        self.process.start()
        self._sentinel = self.process.sentinel
        self._finish_startup()

    @classmethod
    def connect(cls, shared: SharedCore) -> MultiprocessCoreClient:
        """One of several API processes of a core started elsewhere."""
        client = cls.__new__(cls)
        client._dir = None
        client._open(shared.addresses, shared.client_index)
        client.process = None
        client._sentinel = os.pidfd_open(shared.core_pid)
        client._finish_startup()
        return client

    def _open(self, addresses: CoreAddresses, client_index: int) -> None:
        self._client_index = client_index
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # sending never blocks the event loop
        # ... unless no core is connected (ZMQ then waits for one): a dead core's last
        # message (a shutdown) is dropped after this long instead of hanging.
        self._input.setsockopt(zmq.SNDTIMEO, int(CORE_EXIT_TIMEOUT_S * 1000))
        self._input.bind(addresses.inputs[client_index])
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(addresses.outputs[client_index])
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[CoreMessage] = msgspec.msgpack.Decoder(
            CoreMessage  # type: ignore[arg-type]  # a union of tagged Structs
        )
        # Written by `close`, so that the receiver thread stops while the core serves on.
        self._wakeup_read, self._wakeup_write = os.pipe()
        self._closing = False  # set by `close`, once
        self._receiver: threading.Thread | None = None
        # One thread at a time waits for the core's exit: two would race to reap it, and
        # the one that lost would find it still alive (and kill a pid already reaped).
        self._reaping = threading.Lock()

    def _finish_startup(self) -> None:
        try:
            ready = self._wait_ready()
        except BaseException:
            self._stop_process()
            self._cleanup()
            raise
        self.limits = ready.limits
        self.initial_stats = ready.stats
        # The core ignores SIGTERM (only its API side stops it), so multiprocessing's own
        # exit hook, which terminates daemonic children and joins them, would wait forever
        # for a core nobody closed. Registered after that hook, this one runs before it.
        atexit.register(self.close)

    def _core_alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return not select.select([self._sentinel], [], [], 0)[0]  # a pidfd reads at exit

    def _exit_status(self) -> str:
        if self.process is None:
            return "exited"
        with self._reaping:
            self.process.join()
        return f"exited with status {self.process.exitcode}"

    def _wait_ready(self) -> EngineCoreReady:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._sentinel, zmq.POLLIN)
        events = dict(poller.poll(int(CORE_STARTUP_TIMEOUT_S * 1000)))
        if self._output in events:
            message = self._decoder.decode(self._output.recv())
            if isinstance(message, EngineCoreReady):
                return message
            if isinstance(message, EngineCoreFailed):
                raise ValueError(message.error)
        if not events:
            raise RuntimeError(f"the engine core did not start in {CORE_STARTUP_TIMEOUT_S} s")
        raise RuntimeError(f"the engine core {self._exit_status()}")

    def start(
        self, loop: asyncio.AbstractEventLoop, on_outputs: OutputHandler, on_death: DeathHandler
    ) -> None:
        self._receiver = threading.Thread(
            target=self._receive_loop,
            args=(loop, on_outputs, on_death),
            name="octavo-core-receiver",
            daemon=True,
        )
        self._receiver.start()

    def _receive_loop(
        self, loop: asyncio.AbstractEventLoop, on_outputs: OutputHandler, on_death: DeathHandler
    ) -> None:
        """Decodes the core's messages and hands them to the loop, until the process ends
        or `close` says to stop."""
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._sentinel, zmq.POLLIN)
        poller.register(self._wakeup_read, zmq.POLLIN)
        death: EngineCoreDiedError | None = None
        while death is None:
            events = dict(poller.poll())
            while True:  # drain everything the core sent before looking at its exit
                try:
                    data = self._output.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                message = self._decoder.decode(data.buffer)
                if isinstance(message, EngineCoreOutputs):
                    loop.call_soon_threadsafe(on_outputs, message)
                elif isinstance(message, EngineCoreFailed):
                    death = EngineCoreDiedError(f"the engine core failed: {message.error}")
            if self._wakeup_read in events:
                return
            if self._sentinel in events and death is None:
                if self._closing:  # `close` asked for this exit and reaps the process
                    return
                death = EngineCoreDiedError(f"the engine core process {self._exit_status()}")
        logger.error("%s", death)
        loop.call_soon_threadsafe(on_death, death)

    def send(self, inputs: EngineCoreInputs) -> None:
        inputs.client_index = self._client_index
        try:
            self._input.send(self._encoder.encode(inputs), copy=False)
        except zmq.Again:  # SNDTIMEO ran out: no core is connected
            logger.warning("the engine core is gone; %s not delivered", type(inputs).__name__)

    def close(self) -> None:
        """Asks the core to shut down (a shared core: once every API process has), waits
        for a core this process started (terminates it past the timeout), and removes the
        sockets. Idempotent; runs at interpreter exit if nobody called it."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        if self._core_alive():
            self.send(EngineCoreInputs(shutdown=True))
        self._stop_process()
        os.write(self._wakeup_write, b"\0")
        if self._receiver is not None:
            self._receiver.join()
        self._cleanup()

    def _stop_process(self) -> None:
        if self.process is None:  # the supervisor that started it waits for it
            return
        with self._reaping:
            self.process.join(CORE_EXIT_TIMEOUT_S)
            if self.process.is_alive():
                logger.warning("the engine core did not exit; terminating it")
                self.process.kill()
                self.process.join()

    def _cleanup(self) -> None:
        """Closes the sockets (the receiver thread, their other user, has ended)."""
        # A core that is still being asked to shut down gets the time to read it.
        self._input.close(linger=int(CORE_EXIT_TIMEOUT_S * 1000) if self.process is None else 0)
        self._output.close(linger=0)
        self._context.term()
        os.close(self._wakeup_read)
        os.close(self._wakeup_write)
        if self.process is None:
            os.close(self._sentinel)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
