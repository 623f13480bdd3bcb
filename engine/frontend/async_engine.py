"""The server's engine: front end on the event loop, engine core in its own process (or thread),
one async output stream per request."""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable

from octavo.engine.config import EngineConfig
from octavo.engine.core_messages import EngineCoreInputs, EngineCoreOutputs, EngineStats
from octavo.engine.frontend.core_client import (
    EngineCoreClient,
    EngineCoreDiedError,
    InprocessCoreClient,
    MultiprocessCoreClient,
    SharedCore,
)
from octavo.engine.frontend.input_processor import InputProcessor, ProcessedPrompt
from octavo.engine.frontend.output_processor import OutputProcessor, RequestState
from octavo.engine.frontend.outputs import RequestOutput
from octavo.engine.frontend.tokenizer import Tokenizer, load_tokenizer
from octavo.engine.lora_request import LoRARequest
from octavo.engine.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

# After a shutdown aborts what is left, how long aborted streams get to deliver their ends.
ABORT_DRAIN_SECONDS = 5.0
# How often a shutdown looks whether the in-flight requests have finished (grace), and then
# whether the aborted ones' streams have delivered their ends (drain).
GRACE_POLL_SECONDS = 0.05
DRAIN_POLL_SECONDS = 0.01


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_num_waiting` requests already; try again later."""


class UserQueueFullError(RuntimeError):
    """The request's user has `max_num_waiting_per_user` requests waiting; try again later."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or its core died) and takes no new requests."""


class RequestFailedError(RuntimeError):
    """Processing this request raised inside the engine; the engine serves the others on."""


class _OutputStream:
    """One request's outputs on their way to its consumer (vLLM's RequestOutputCollector).

    Holds no output, only whether one is due: the output is built from the request's state
    when the consumer takes it (`OutputProcessor.build`), so a consumer that falls behind
    gets one output for every step since it last read, built once. An error replaces
    anything, and ends the stream. The consumer waits on a bare future, made only when
    nothing is due: asyncio.Event makes a future per wait too, and adds a loop-binding
    check and a waiter deque to every wait and set, which every event would pay for.
    """

    def __init__(self, build: Callable[[RequestState], RequestOutput | None]):
        self._build = build
        self._due: RequestState | None = None
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, state: RequestState) -> None:
        """An output of the request is due."""
        self._due = state
        self._wake()

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a cancelled consumer's future is done already
                waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while True:
            if self._error is not None:
                raise self._error
            state = self._due
            if state is None:
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
                continue
            self._due = None
            output = self._build(state)
            if output is not None:
                return output


class AsyncEngine:
    """Requests in, async streams of RequestOutputs out, with the core stepping elsewhere.

    On the event loop: validation and tokenization (`InputProcessor`, so a bad request raises
    ValueError before anything is queued), detokenization and stop strings
    (`OutputProcessor`), and the streams. Everything bound for the core in one loop iteration
    (requests, aborts, stop-string sample aborts) travels as one message, applied before the
    core's next step, so an abort frees its blocks within one step; each step's outputs come
    back as one message. A stream's output is built when its consumer takes it, so one that
    falls behind gets everything since it last read in one output (`_OutputStream`).
    """

    def __init__(
        self,
        client: EngineCoreClient,
        tokenizer: Tokenizer | None,
        max_num_waiting: int,
        stream_interval: int = 1,
        max_num_waiting_per_user: int | None = None,
    ):
        """`stream_interval`: a stream's outputs after its first come every this many tokens
        (and at its finish); see OutputProcessor. `max_num_waiting_per_user`: how many
        requests of one user may wait (None: no bound but the global one)."""
        if max_num_waiting < 1:
            raise ValueError(f"max_num_waiting must be >= 1, got {max_num_waiting}")
        if max_num_waiting_per_user is not None and max_num_waiting_per_user < 1:
            raise ValueError(
                f"max_num_waiting_per_user must be >= 1, got {max_num_waiting_per_user}"
            )
        self.client = client
        self.max_num_waiting = max_num_waiting
        self.max_num_waiting_per_user = max_num_waiting_per_user
        # Each unfinished request's user, and how many unfinished requests each user has.
        self._request_users: dict[str, str] = {}
        self._num_unfinished_per_user: Counter[str] = Counter()
        self.input_processor = InputProcessor(tokenizer, client.limits)
        self.output_processor = OutputProcessor(tokenizer, stream_interval)
        self._streams: dict[str, _OutputStream] = {}
        self._stats = client.initial_stats
        self._num_requests_sent = client.initial_stats.num_requests_added
        self._pending = EngineCoreInputs()
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = True
        self._dead: BaseException | None = None
        self._shutdown: asyncio.Future[None] | None = None
        self._grace_deadline = math.inf  # loop time at which a shutdown aborts what is left
        self._fatal_handler: Callable[[BaseException], None] | None = None

    @classmethod
    def multiprocess(
        cls,
        config: EngineConfig,
        max_num_waiting: int,
        core_threads: int | None = None,
        max_num_waiting_per_user: int | None = None,
    ) -> AsyncEngine:
        """The core in a process of its own with `core_threads` torch threads; returns once
        it is up (ValueError with the core's message if it could not start)."""
        client = MultiprocessCoreClient(config, core_threads)
        tokenizer = load_tokenizer(config.model, config.load_format)
        return cls(
            client, tokenizer, max_num_waiting, config.stream_interval, max_num_waiting_per_user
        )

    @classmethod
    def sharing(
        cls,
        config: EngineConfig,
        max_num_waiting: int,
        shared: SharedCore,
        max_num_waiting_per_user: int | None = None,
    ) -> AsyncEngine:
        """One of several API processes in front of a core their supervisor started."""
        client = MultiprocessCoreClient.connect(shared)
        tokenizer = load_tokenizer(config.model, config.load_format)
        return cls(
            client, tokenizer, max_num_waiting, config.stream_interval, max_num_waiting_per_user
        )

    @classmethod
    def in_process(
        cls,
        config: EngineConfig,
        max_num_waiting: int,
        max_num_waiting_per_user: int | None = None,
    ) -> AsyncEngine:
        """The core in a thread of this process (`client.core` is reachable)."""
        # Here, not at the top: a process whose core runs elsewhere never loads torch.
        from octavo.engine.core.engine_core import EngineCore

        client = InprocessCoreClient(EngineCore(config))
        tokenizer = load_tokenizer(config.model, config.load_format)
        return cls(
            client, tokenizer, max_num_waiting, config.stream_interval, max_num_waiting_per_user
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Connects the core's outputs to this event loop; call from the loop."""
        self._loop = asyncio.get_running_loop()
        self.client.start(self._loop, self._on_outputs, self._on_death)
        self._schedule_flush()  # requests added before the loop ran

    async def shutdown(self, grace_seconds: float) -> None:
        """Stops admitting, lets in-flight requests finish for `grace_seconds`, aborts the rest
        (their streams end with finish_reason "abort"), then stops the core. Idempotent:
        later calls wait for the first one, whose grace ends when theirs does if that is sooner
        (a second Ctrl-C: abort now)."""
        deadline = asyncio.get_running_loop().time() + grace_seconds
        self._grace_deadline = min(self._grace_deadline, deadline)
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._shutdown_now())
        await asyncio.shield(self._shutdown)

    async def _shutdown_now(self) -> None:
        self._accepting = False
        loop = asyncio.get_running_loop()
        while self._streams and loop.time() < self._grace_deadline:
            await asyncio.sleep(GRACE_POLL_SECONDS)
        for request_id in list(self._streams):
            self.abort(request_id)
        # Consumers receive their "abort" outputs and close their streams; a stream whose
        # consumer never started cannot close, hence the bound.
        deadline = loop.time() + ABORT_DRAIN_SECONDS
        while self._streams and loop.time() < deadline and self._dead is None:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        self._flush()
        await asyncio.to_thread(self.client.close)

    def on_fatal(self, handler: Callable[[BaseException], None]) -> None:
        """Registers what runs on the event loop, after every stream got its error, when the
        core dies (a step failed, its process was killed): the server exits so that it is
        restarted."""
        self._fatal_handler = handler

    @property
    def accepting(self) -> bool:
        return self._accepting and self._dead is None

    # -- requests ----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The core's stats after its latest step."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission, those still on their way to the core included."""
        in_flight = self._num_requests_sent - self._stats.num_requests_added
        return self._stats.num_waiting_requests + in_flight

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None for a checkpoint without tokenizer.json)."""
        return self.input_processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.client.limits.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.limits.vocab_size

    def num_waiting_of(self, user: str) -> int:
        """Requests of `user` waiting for admission: its unfinished requests less those the
        core runs as of its latest count of them (`EngineStats.users`, a little behind the
        queues, so a request admitted since still counts as waiting). A user past the
        bounded set of series has no count of its own: all its unfinished requests count."""
        unfinished = self._num_unfinished_per_user[user]
        series = self._stats.users.get(user)
        return unfinished - (series.num_running if series is not None else 0)

    def process_inputs(
        self, prompt: str | list[int], params: SamplingParams | BeamSearchParams
    ) -> ProcessedPrompt:
        return self.input_processor.process_inputs(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        user: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Queues a validated request and returns its output stream (call on the loop);
        `priority` and `user`: what the scheduling policy orders it by.

        Raises EngineStoppedError when shutting down, QueueFullError when max_num_waiting
        requests are waiting, UserQueueFullError when `user` has max_num_waiting_per_user
        waiting, ValueError for a request id in use. The stream yields outputs
        as the request's output kind says and ends after the finished one; closing it early
        (a client that went away) aborts the request.
        """
        if not self.accepting:
            raise EngineStoppedError("the engine is shutting down")
        if request_id in self._streams or self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.num_waiting >= self.max_num_waiting:
            raise QueueFullError(f"{self.max_num_waiting} requests are already waiting")
        limit = self.max_num_waiting_per_user
        if limit is not None and self.num_waiting_of(user) >= limit:
            raise UserQueueFullError(f"{limit} requests of this user are already waiting")
        request = self.input_processor.core_request(
            request_id, prompt, params, arrival_time, lora_request, priority, user
        )
        stream = _OutputStream(self.output_processor.build)
        self._streams[request_id] = stream
        self.output_processor.add_request(
            request_id, prompt.text, prompt.token_ids, params, arrival_time
        )
        self._pending.requests.append(request)
        self._num_requests_sent += 1
        self._request_users[request_id] = user
        self._num_unfinished_per_user[user] += 1
        self._schedule_flush()
        return self._iterate(request_id, stream)

    async def _iterate(
        self, request_id: str, stream: _OutputStream
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Aborts a request in the core before its next step (its stream, if still read,
        ends with finish_reason "abort"); a no-op if unknown. Call on the loop."""
        if self.output_processor.has_request(request_id):
            self._pending.aborts.append(request_id)
            self._schedule_flush()

    def discard(self, request_id: str) -> None:
        """Aborts a request whose stream will never be iterated, and drops the stream."""
        self._streams.pop(request_id, None)
        self.abort(request_id)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Sends everything queued for the core in this loop iteration as one message."""
        self._flush_scheduled = False
        pending = self._pending
        if pending.requests or pending.aborts or pending.sample_aborts:
            self._pending = EngineCoreInputs()
            if self._dead is None:
                self.client.send(pending)

    # -- callbacks from the core client (on the loop) ----------------------------------------

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        self._stats = outputs.stats
        updated = self.output_processor.update(outputs.outputs)
        streams = self._streams
        for state in updated.ready:
            stream = streams.get(state.request_id)
            if stream is None:
                continue
            if state.error is not None:
                stream.fail(RequestFailedError(state.error))
            else:
                stream.put(state)
        for request_id in updated.finished:
            user = self._request_users.pop(request_id)
            self._num_unfinished_per_user[user] -= 1
            if not self._num_unfinished_per_user[user]:  # no user outlives its requests
                del self._num_unfinished_per_user[user]
        if updated.sample_aborts or updated.aborts:
            self._pending.sample_aborts.extend(updated.sample_aborts)
            self._pending.aborts.extend(updated.aborts)
            self._schedule_flush()

    def _on_death(self, exc: BaseException) -> None:
        self._dead = exc
        for request_id, stream in self._streams.items():
            stream.fail(EngineStoppedError(f"the engine core died: {exc}"))
            self.output_processor.forget(request_id)
        if self._fatal_handler is not None:
            self._fatal_handler(exc)


__all__ = [
    "ABORT_DRAIN_SECONDS",
    "AsyncEngine",
    "EngineCoreDiedError",
    "EngineStoppedError",
    "QueueFullError",
    "RequestFailedError",
    "UserQueueFullError",
]
