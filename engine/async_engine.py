"""The engine core stepping in a background thread, with one async output stream per request."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from octavo.engine.llm_engine import EngineStats, LLMEngine, ProcessedPrompt
from octavo.engine.outputs import RequestOutput
from octavo.engine.sampling_params import BeamSearchParams, SamplingParams
from octavo.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# After a shutdown aborts what is left, how long aborted streams get to deliver their ends.
ABORT_DRAIN_SECONDS = 5.0


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_num_waiting` requests already; try again later."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or its loop died) and takes no new requests."""


class RequestFailedError(RuntimeError):
    """Processing this request raised inside the engine; the engine serves the others on."""


@dataclass(frozen=True)
class _AddRequest:
    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams | BeamSearchParams
    arrival_time: float


@dataclass(frozen=True)
class _AbortRequest:
    request_id: str


@dataclass(frozen=True)
class _Stop:
    pass


_Command = _AddRequest | _AbortRequest | _Stop


class AsyncEngine:
    """Runs `LLMEngine.step()` continuously in its own thread while requests come and go.

    The event loop never touches the LLMEngine's mutable state: requests and aborts travel to
    the engine thread through a command queue, drained before every step (so an abort frees
    its blocks within one step), and each step's outputs come back to the loop in one
    `call_soon_threadsafe`. Validation (`process_inputs`) is pure and runs in the caller, so a
    bad request raises ValueError before anything is queued. The thread sleeps on the command
    queue while no request is unfinished (no busy loop).

    A torch step releases the GIL for its heavy ops, so the loop keeps serving HTTP while the
    engine computes; a separate process would add IPC serialization per token for no gain on
    a 2-core machine.
    """

    def __init__(self, engine: LLMEngine, max_num_waiting: int):
        if max_num_waiting < 1:
            raise ValueError(f"max_num_waiting must be >= 1, got {max_num_waiting}")
        self.engine = engine
        self.max_num_waiting = max_num_waiting
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._num_pending_adds = 0  # submitted, not yet drained by the engine thread
        self._stats = engine.stats()
        self._accepting = True
        self._dead: BaseException | None = None
        self._shutdown: asyncio.Future[None] | None = None
        self._fatal_handler: Callable[[BaseException], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="octavo-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, grace_seconds: float) -> None:
        """Stops admitting, lets in-flight requests finish for `grace_seconds`, aborts the rest
        (their streams end with finish_reason "abort"), then stops the thread. Idempotent:
        later calls wait for the first one."""
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._shutdown_now(grace_seconds))
        await asyncio.shield(self._shutdown)

    async def _shutdown_now(self, grace_seconds: float) -> None:
        self._accepting = False
        deadline = asyncio.get_running_loop().time() + grace_seconds
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        # Consumers receive their "abort" outputs and close their streams; a stream whose
        # consumer never started cannot close, hence the bound.
        deadline = asyncio.get_running_loop().time() + ABORT_DRAIN_SECONDS
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        self._commands.put(_Stop())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def on_fatal(self, handler: Callable[[BaseException], None]) -> None:
        """Registers what runs on the event loop, after every stream got its error, when a
        step itself fails (the loop cannot go on): the server exits so that it is restarted."""
        self._fatal_handler = handler

    @property
    def accepting(self) -> bool:
        return self._accepting and self._dead is None

    # -- requests ----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The snapshot published after the latest step."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return self._stats.num_waiting_requests + self._num_pending_adds

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None for a checkpoint without tokenizer.json)."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def process_inputs(
        self, prompt: str | list[int], params: SamplingParams | BeamSearchParams
    ) -> ProcessedPrompt:
        return self.engine.process_inputs(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float,
    ) -> AsyncIterator[RequestOutput]:
        """Queues a validated request and returns its output stream.

        Raises EngineStoppedError when shutting down, QueueFullError when max_num_waiting
        requests are waiting, ValueError for a duplicate request id. The stream yields a
        RequestOutput per step that produced tokens and ends after the finished one; closing
        it early (a client that went away) aborts the request.
        """
        if not self.accepting:
            raise EngineStoppedError("the engine is shutting down")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        with self._lock:
            if self._stats.num_waiting_requests + self._num_pending_adds >= self.max_num_waiting:
                raise QueueFullError(f"{self.max_num_waiting} requests are already waiting")
            self._num_pending_adds += 1
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(_AddRequest(request_id, prompt, params, arrival_time))
        return self._iterate(request_id, stream)

    async def _iterate(
        self, request_id: str, stream: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Aborts a request in the engine thread before its next step; a no-op if unknown."""
        self._commands.put(_AbortRequest(request_id))

    def discard(self, request_id: str) -> None:
        """Aborts a request whose stream will never be iterated, and drops the stream."""
        self._streams.pop(request_id, None)
        self.abort(request_id)

    # -- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._drain_commands():
                outputs = self.engine.step()
                self._publish(outputs)
        except BaseException as exc:  # an engine bug: fail every stream instead of hanging
            logger.exception("engine loop died")
            self._dead = exc
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _drain_commands(self) -> bool:
        """Applies queued commands; blocks while idle. False once asked to stop."""
        block = not self.engine.has_unfinished_requests()
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _AbortRequest):
                final = self.engine.abort_request(command.request_id)
                if final is not None:
                    self._publish([final])
                continue
            self._add(command)
            block = not self.engine.has_unfinished_requests()

    def _add(self, command: _AddRequest) -> None:
        try:
            self.engine.add_request(
                command.request_id, command.prompt, command.params, command.arrival_time
            )
        except ValueError as exc:  # e.g. an id reused after its stream closed
            self._deliver_error(command.request_id, exc)
        except Exception as exc:  # noqa: BLE001 -- fails this request, not the loop
            logger.exception("adding request %s failed", command.request_id)
            self._deliver_error(
                command.request_id, RequestFailedError(f"{type(exc).__name__}: {exc}")
            )
        finally:
            with self._lock:
                self._num_pending_adds -= 1
                self._stats = self.engine.stats()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        stats = self.engine.stats()
        with self._lock:
            self._stats = stats
        if outputs:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver_one_error, request_id, exc)

    # -- on the event loop -------------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.error is not None:
                stream.put_nowait(RequestFailedError(output.error))
            else:
                stream.put_nowait(output)

    def _deliver_one_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(EngineStoppedError(f"the engine loop died: {exc!r}"))
        if self._fatal_handler is not None:
            self._fatal_handler(exc)
