"""What every generating route shares: the server's settings, the route's steps from request
to response (`EngineServing.serve`), request checks, engine parameters, submission, the
merged output streams and the error contract."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response

from octavo.engine.errors import ParameterError
from octavo.engine.frontend.async_engine import (
    AsyncEngine,
    EngineStoppedError,
    QueueFullError,
    RequestFailedError,
    UserQueueFullError,
)
from octavo.engine.frontend.input_processor import ProcessedPrompt
from octavo.engine.frontend.outputs import RequestOutput
from octavo.engine.frontend.tokenizer import Tokenizer
from octavo.engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from octavo.engine.structured_outputs import compile_grammar
from octavo.server.errors import APIError, bad_request, model_not_found
from octavo.server.metrics import ServerMetrics
from octavo.server.protocol import GenerationRequest, PromptLogprob, PromptTokensDetails, Usage
from octavo.server.streaming import EventEncoder, EventStreamResponse, until_disconnect

if TYPE_CHECKING:
    from octavo.engine.lora_request import LoRARequest
    from octavo.server.chat_template import ChatTemplate
    from octavo.server.lora_modules import LoRAModules
    from octavo.server.stream_builder import StreamBuilder

# Seconds a client told "queue full" should wait before retrying.
RETRY_AFTER_SECONDS = 1
# A constraint that takes longer to compile is refused (a 400), and reaches no engine.
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
LOGIT_BIAS_LIMIT = 100.0  # OpenAI clamps each logit_bias value to [-100, 100]

logger = logging.getLogger(__name__)
PromptAndParams = tuple[ProcessedPrompt, SamplingParams | BeamSearchParams]
Outputs = AsyncGenerator[tuple[int, RequestOutput], None]  # `EngineServing.merge`'s


class RouteRequest(Protocol):
    """What the route's steps read of its request (a pydantic model)."""

    @property
    def model(self) -> str: ...

    @property
    def stream(self) -> bool | None: ...

    @property
    def priority(self) -> int | None: ...

    @property
    def user(self) -> str | None: ...


RequestT = TypeVar("RequestT", bound=RouteRequest)


@dataclass(frozen=True, slots=True)
class Generation(Generic[RequestT]):
    """A request whose prompts are queued: what its stream or its response is built from."""

    request: RequestT
    request_id: str
    created: int  # when it was queued: the response's created (created_at)
    prompts: list[PromptAndParams]


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer enforces; `max_n` bounds n and best_of per request (None: no
    bound beyond the engine's max_num_seqs); `allowed_hosts` None accepts any Host;
    `chat_template` None answers chat requests with a 400 naming --chat-template."""

    served_model_name: str
    model_root: str = ""  # the checkpoint served (the model cards' `root`); "" = the name
    # Each accepted bearer key and the user it stands for (the fair policy's, the per-user
    # metrics'); None: no auth.
    api_keys: dict[str, str] | None = None
    max_body_bytes: int = 4 << 20
    shutdown_grace_seconds: float = 10.0
    max_n: int | None = None
    allowed_hosts: tuple[str, ...] | None = None
    chat_template: ChatTemplate | None = None
    # tool_choice "auto": the parser of the model's calls (--tool-call-parser, only with
    # --enable-auto-tool-choice); None answers "auto" with tools with a 400.
    tool_call_parser: str | None = None
    # The LoRA adapters served by name (--enable-lora); None: the base model alone.
    lora: LoRAModules | None = None
    allow_runtime_lora_updating: bool = False
    # prometheus-client's multiprocess folder when several API processes share /metrics.
    metrics_dir: str | None = None

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 if neither."""
        if self.lora is not None:
            return self.lora.resolve(model)
        if model != self.served_model_name:
            raise model_not_found(model)
        return None


class EngineServing(ABC, Generic[RequestT]):
    """A generating route around the AsyncEngine, one request at a time (`serve`): check it
    and turn each prompt into engine inputs (the route's `preprocess`: `check_request`,
    `compile_constraint`, `process`), queue them (`submit`), read their outputs as they
    arrive (`merge`) into a stream (the route's `stream_type`) or one response (the route's
    `response`). Everything a client can get wrong is an APIError (400/404/503) before any
    engine request is queued, or, if the queue fills midway, after the ones already queued
    are aborted."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics):
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.tokenizer: Tokenizer | None = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.events = EventEncoder()

    # -- the route ---------------------------------------------------------------------------

    id_prefix: str  # of the route's response ids, before a random hex (cmpl-, chatcmpl-, ...)
    stream_type: type[StreamBuilder]  # the builder of the route's streams

    async def serve(self, request: RequestT, raw_request: Request) -> Response:
        """The response to one request: an SSE stream, or the JSON response once every
        engine request has ended; a client that disconnects first (`raw_request` says so)
        gets its requests aborted, as a stream's would be."""
        prompts = await self.preprocess(request)
        request_id = f"{self.id_prefix}{uuid.uuid4().hex}"
        generation = Generation(request, request_id, int(time.time()), prompts)
        # Whom it is served for (the fair policy's user): its API key's user where the server
        # has keys, else the request's `user` field ("": anonymous).
        user = (
            raw_request.state.api_user if self.config.api_keys is not None else request.user or ""
        )
        outputs = self.merge(self.submit(generation, user))
        if request.stream:
            return EventStreamResponse(self.stream_type(self, generation).events(outputs))
        return await json_unless_disconnected(raw_request, self._respond(generation, outputs))

    @abstractmethod
    async def preprocess(self, request: RequestT) -> list[PromptAndParams]:
        """The request checked, and its prompts as engine inputs."""

    @abstractmethod
    def response(self, generation: Generation[RequestT], finals: list[RequestOutput]) -> BaseModel:
        """The non-streamed response: `finals` holds each prompt's final output."""

    async def _respond(self, generation: Generation[RequestT], outputs: Outputs) -> BaseModel:
        ended: dict[int, RequestOutput] = {}
        try:
            async for index, output in outputs:
                ended[index] = output
        except Exception as exc:
            raise engine_error(exc) from exc
        finals = [ended[index] for index in range(len(generation.prompts))]
        for final in finals:
            assert final.finished
            if final.metrics is not None:
                self.metrics.observe_finished(final.metrics)
        return self.response(generation, finals)

    # -- validation --------------------------------------------------------------------------

    def check_request(self, request: GenerationRequest, num_prompts: int) -> None:
        """The checks that need the server's settings, for a request of `num_prompts`."""
        self.config.lora_request(request.model)  # 404 for a model this server does not serve
        max_n = self.config.max_n
        for param, value in (("n", request.n), ("best_of", request.best_of)):
            if max_n is not None and value is not None and value > max_n:
                raise bad_request(
                    f"{param} must be <= {max_n} on this server (--max-n), got {value}", param=param
                )
        if num_prompts > self.engine.max_num_waiting:
            raise bad_request(
                f"{num_prompts} prompts can never wait at once: the queue holds "
                f"{self.engine.max_num_waiting} (--max-num-waiting)",
                param="prompt",
            )
        per_user = self.engine.max_num_waiting_per_user
        if per_user is not None and num_prompts > per_user:
            raise bad_request(
                f"{num_prompts} prompts can never wait at once: a user's share of the queue "
                f"holds {per_user} (--max-num-waiting-per-user)",
                param="prompt",
            )
        if request.best_of is not None and request.best_of < request.n:
            raise bad_request(
                f"best_of ({request.best_of}) must be >= n ({request.n})", param="best_of"
            )
        if request.use_beam_search:
            _check_beam_search(request)
        elif request.best_of is not None and request.best_of > request.n and request.stream:
            raise bad_request(
                "best_of > n cannot be streamed: the best samples are known at the end",
                param="best_of",
            )
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed with stream", param="stream_options")

    # -- engine inputs -----------------------------------------------------------------------

    async def compile_constraint(self, request: GenerationRequest) -> None:
        """Compiles the request's structured-output constraint in a thread (llguidance
        releases the GIL while it builds a grammar), so that a large one never stalls the
        other streams of this event loop; `process` then finds it compiled, in the cache.
        A compile past GRAMMAR_COMPILE_TIMEOUT_S is a 400 naming the constraint's field; an
        invalid constraint is left to `process`, which names the field too."""
        try:
            constraint = request.structured_outputs_params()
            if constraint is not None:
                await asyncio.wait_for(
                    asyncio.to_thread(compile_grammar, constraint), GRAMMAR_COMPILE_TIMEOUT_S
                )
        except ParameterError:
            return
        except TimeoutError:
            raise bad_request(
                f"the structured-output constraint took longer than "
                f"{GRAMMAR_COMPILE_TIMEOUT_S:g} s to compile",
                param=request.constraint_fields[0],
            ) from None

    def process(self, request: GenerationRequest, prompt: str | list[int]) -> PromptAndParams:
        """Tokenizes and validates one prompt; max_tokens defaults to the room left in the
        context, and a prompt plus max_tokens that overflow the context is a 400. The echoed
        text is the prompt as sent (vLLM's), even where truncate_prompt_tokens cut it."""
        max_tokens = request.max_new_tokens()
        try:
            if max_tokens is None:
                # Checked at the context's length: a sequence ends there either way, as it
                # does at the room the prompt leaves, which is known once it is tokenized.
                params = self.sampling_params(request, max(self.max_model_len, request.min_tokens))
            else:  # max_tokens 0 (an echoed prompt scored): one token computed, none returned
                params = self.sampling_params(request, max(max_tokens, 1))
            processed = self.engine.process_inputs(prompt, params)
            room = self.max_model_len - len(processed.token_ids)
            if max_tokens is None:  # the dataclass checks min_tokens against it again
                params = dataclasses.replace(params, max_tokens=max(room, 1))
            elif max_tokens > room:
                raise ParameterError(
                    "max_tokens",
                    f"This model's maximum context length is {self.max_model_len} tokens; the "
                    f"prompt has {len(processed.token_ids)} and max_tokens is {max_tokens}",
                )
            text = prompt if isinstance(prompt, str) else None
            return dataclasses.replace(processed, text=text), params
        except ParameterError as exc:
            raise bad_request(str(exc), param=request.client_param(exc.param)) from exc

    @staticmethod
    def sampling_params(
        request: GenerationRequest, max_tokens: int
    ) -> SamplingParams | BeamSearchParams:
        """The engine parameters of a request. A stream takes delta outputs (each event is
        what one or more steps added); a plain response only the final output."""
        structured_outputs = request.structured_outputs_params()
        if request.use_beam_search:
            return BeamSearchParams(
                beam_width=request.best_of or request.n,
                max_tokens=max_tokens,
                num_return_sequences=request.n,
                length_penalty=request.length_penalty,
                early_stopping=request.early_stopping,
                min_tokens=request.min_tokens,
                ignore_eos=request.ignore_eos,
                stop_token_ids=request.stop_token_ids or [],
                skip_special_tokens=request.skip_special_tokens,
                structured_outputs=structured_outputs,
            )
        return SamplingParams(
            n=request.n,
            best_of=request.best_of,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=max(request.top_k, 0),
            min_p=request.min_p,
            seed=request.seed,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids or [],
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=request.sample_logprobs(),
            prompt_logprobs=request.scored_prompt_logprobs(),
            logit_bias=_logit_bias(request.logit_bias),
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            structured_outputs=structured_outputs,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
        )

    def submit(
        self, generation: Generation[RequestT], user: str
    ) -> list[AsyncIterator[RequestOutput]]:
        """Queues one engine request per prompt of `generation` (`{request_id}-{i}`), under
        the LoRA adapter the request's `model` names (the base's name: the base), with its
        priority and `user` (what the scheduling policy orders it by); their output streams.
        A priority the engine refuses is a 400, a user with a full share of the queue a 429,
        a full queue or a stopped engine a 503, and each leaves nothing queued."""
        request, request_id = generation.request, generation.request_id
        arrival = time.monotonic()
        lora_request = self.config.lora_request(request.model)
        priority = request.priority or 0
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for i, (prompt, params) in enumerate(generation.prompts):
                streams.append(
                    self.engine.add_request(
                        f"{request_id}-{i}", prompt, params, arrival, lora_request, priority, user
                    )
                )
        except (ParameterError, UserQueueFullError, QueueFullError, EngineStoppedError) as exc:
            for i in range(len(streams)):
                self.engine.discard(f"{request_id}-{i}")
            if isinstance(exc, ParameterError):
                raise bad_request(str(exc), param=exc.param) from exc
            raise APIError(
                HTTPStatus.TOO_MANY_REQUESTS
                if isinstance(exc, UserQueueFullError)
                else HTTPStatus.SERVICE_UNAVAILABLE,
                str(exc),
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from exc
        return streams

    # -- outputs -----------------------------------------------------------------------------

    async def merge(self, streams: list[AsyncIterator[RequestOutput]]) -> Outputs:
        """Interleaves several output streams as outputs arrive (a task reads each one into
        one queue), observing each one's inter-token latency; closing this generator (a
        client that went away) cancels them all, which aborts their requests."""
        observe = self.metrics.itl.observe
        if len(streams) == 1:  # the common case, without a task per stream
            last = None
            async for output in streams[0]:
                now = time.monotonic()
                if last is not None:
                    observe(now - last)
                last = now
                yield 0, output
            return
        arrived: dict[int, float] = {}  # when each stream's last output came
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
            except Exception as exc:
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    now = time.monotonic()
                    if index in arrived:
                        observe(now - arrived[index])
                    arrived[index] = now
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def vllm_prompt_logprobs(
        self, output: RequestOutput, request: GenerationRequest
    ) -> list[dict[str, PromptLogprob] | None] | None:
        """vLLM's prompt_logprobs of an output, when the request asked for them: per prompt
        token (None for the first) the prompt token with its rank, then the best tokens,
        ranked 1, 2, ... (skipping the prompt token's own rank when it is among them)."""
        if request.prompt_logprobs is None:
            return None
        entries, ranks = output.prompt_logprobs, output.prompt_token_ranks
        assert entries is not None and ranks is not None, "asked for, so computed"
        result: list[dict[str, PromptLogprob] | None] = []
        for entry, token_rank in zip(entries, ranks, strict=True):
            if entry is None or token_rank is None:
                result.append(None)
                continue
            prompt_token, *best = entry
            scored = {str(prompt_token): self._scored(prompt_token, entry, token_rank)}
            rank = 1
            for token in best:
                rank += rank == token_rank  # that place is the prompt token's
                scored[str(token)] = self._scored(token, entry, rank)
                rank += 1
            result.append(scored)
        return result

    def _scored(self, token: int, entry: dict[int, float], rank: int) -> PromptLogprob:
        return PromptLogprob(logprob=entry[token], rank=rank, decoded_token=self.token_text(token))

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it (special tokens included)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _check_beam_search(request: GenerationRequest) -> None:
    """Beam search (vLLM's use_beam_search: best_of beams, the n best returned) ranks
    whole sequences, so it has no stream, no per-token logprobs and no stop strings."""
    unsupported = [
        ("stream", request.stream),
        ("logprobs", request.sample_logprobs() is not None),
        ("prompt_logprobs", request.prompt_logprobs is not None),
        ("stop", bool(request.stop)),
        ("logit_bias", bool(request.logit_bias)),
        ("allowed_token_ids", request.allowed_token_ids is not None),
        ("bad_words", bool(request.bad_words)),
    ]
    for param, present in unsupported:
        if present:
            raise bad_request(f"{param} is not supported with use_beam_search", param=param)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as strings) as the engine's, each bias clamped to
    [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT] as OpenAI does."""
    if not bias:
        return None
    converted = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit():
            raise ParameterError("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        converted[int(key)] = min(max(value, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
    return converted


def engine_error(exc: Exception) -> APIError:
    """What a client is told when its request's outputs end in an exception: the engine is
    stopping (503), the request was refused on admission (400) or failed inside the engine
    while the engine went on serving others (500); anything else is a server bug (500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineStoppedError):
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
    if isinstance(exc, ParameterError):
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, RequestFailedError):
        return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"the request failed: {exc}")
    logger.error("request failed", exc_info=exc)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(exc).__name__}")


async def json_unless_disconnected(raw_request: Request, work: Awaitable[BaseModel]) -> Response:
    """The JSON response of what `work` returns, awaited while listening for the client's
    disconnect (the body has been read, so the next ASGI message is http.disconnect). A
    disconnect cancels `work`, whose closed output streams abort their requests, and gets a
    204: nobody reads it.

    `work` runs in this task, which the listener cancels: no task for `work`, no
    `asyncio.wait` over the two, on every request."""
    task = asyncio.current_task()
    assert task is not None, "called from a task (a request's)"
    disconnected = False

    async def listen() -> None:
        nonlocal disconnected
        await until_disconnect(raw_request.receive)
        disconnected = True
        task.cancel()

    listener = asyncio.ensure_future(listen())
    try:
        result = await work
    except asyncio.CancelledError:
        if not disconnected:  # cancelled from elsewhere (a shutdown): not this function's
            raise
        task.uncancel()
        return Response(status_code=HTTPStatus.NO_CONTENT)
    finally:
        listener.cancel()
    # pydantic serializes in Rust, with no dict built first for json.dumps.
    return Response(result.model_dump_json(), media_type="application/json")


def usage(prompts: list[PromptAndParams], completion_tokens: int, cached_tokens: int) -> Usage:
    """Token counts of a response: every prompt (`cached_tokens` of them found in the prefix
    cache), and the completion tokens returned."""
    prompt_tokens = sum(len(p.token_ids) for p, _ in prompts)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )
