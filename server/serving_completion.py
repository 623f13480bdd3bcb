"""POST /v1/completions: request -> engine requests -> a JSON response or an SSE stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from octavo.engine.async_engine import (
    AsyncEngine,
    EngineStoppedError,
    QueueFullError,
    RequestFailedError,
)
from octavo.engine.errors import ParameterError
from octavo.engine.input_processor import ProcessedPrompt
from octavo.engine.outputs import CompletionOutput, RequestOutput
from octavo.engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from octavo.engine.tokenizer import Tokenizer
from octavo.server.errors import APIError, model_not_found
from octavo.server.metrics import ServerMetrics
from octavo.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Logprobs,
    PromptLogprob,
    Usage,
    completion_id,
)
from octavo.server.streaming import SSE_DONE, Delta, sse_event

# Seconds a client told "queue full" should wait before retrying.
RETRY_AFTER_SECONDS = 1
LOGIT_BIAS_LIMIT = 100.0  # OpenAI clamps each logit_bias value to [-100, 100]

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer enforces; `max_n` bounds n and best_of per request (None: no
    bound beyond the engine's max_num_seqs); `allowed_hosts` None accepts any Host."""

    served_model_name: str
    model_root: str = ""  # the checkpoint served (the model cards' `root`); "" = the name
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    shutdown_grace_seconds: float = 10.0
    max_n: int | None = None
    allowed_hosts: tuple[str, ...] | None = None


class CompletionServing:
    """Converts an OpenAI completion request at the edge and runs it on the AsyncEngine.

    A request with k prompts and n samples becomes k engine requests; choice `i * n + j` is
    sample j of prompt i. Everything a client can get wrong is answered with an APIError
    (400/404/503) before any engine request is queued, or, if the queue fills midway, after
    the ones already queued are aborted.
    """

    def __init__(self, engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics):
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.tokenizer: Tokenizer | None = engine.tokenizer
        self.max_model_len = engine.max_model_len

    async def create(
        self, request: CompletionRequest, raw_request: Request
    ) -> JSONResponse | StreamingResponse | Response:
        """The response to one completion request. A non-streaming request whose client
        disconnects (`raw_request` says so) is aborted like a stream whose client left."""
        self._check_supported(request)
        prompts = [self._process(request, p) for p in request.prompts()]
        request_id = completion_id()
        streams = self._submit(request_id, prompts)
        if request.stream:
            body = self._stream(request_id, request, prompts, streams)
            return StreamingResponse(body, media_type="text/event-stream")
        completion = self._complete(request_id, request, prompts, streams)
        result = await _unless_disconnected(raw_request, completion)
        if result is None:  # nobody is listening; the requests are aborted
            return Response(status_code=HTTPStatus.NO_CONTENT)
        return JSONResponse(result.model_dump())

    # -- validation --------------------------------------------------------------------------

    def _check_supported(self, request: CompletionRequest) -> None:
        if request.model != self.config.served_model_name:
            raise model_not_found(request.model)
        max_n = self.config.max_n
        for param, value in (("n", request.n), ("best_of", request.best_of)):
            if max_n is not None and value is not None and value > max_n:
                raise APIError(
                    HTTPStatus.BAD_REQUEST,
                    f"{param} must be <= {max_n} on this server (--max-n), got {value}",
                    param=param,
                )
        num_prompts = len(request.prompts())
        if num_prompts > self.engine.max_num_waiting:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"{num_prompts} prompts can never wait at once: the queue holds "
                f"{self.engine.max_num_waiting} (--max-num-waiting)",
                param="prompt",
            )
        if request.use_beam_search:
            self._check_beam_search(request)
        elif request.best_of is not None and request.best_of < request.n:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"best_of ({request.best_of}) must be >= n ({request.n})",
                param="best_of",
            )
        elif request.best_of is not None and request.best_of > request.n and request.stream:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                "best_of > n cannot be streamed: the best samples are known at the end",
                param="best_of",
            )
        if request.suffix:
            raise APIError(HTTPStatus.BAD_REQUEST, "suffix is not supported", param="suffix")
        if request.max_tokens == 0 and not request.echo:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                "max_tokens must be >= 1 (0 only scores an echoed prompt: set echo)",
                param="max_tokens",
            )
        echo_logprobs = request.logprobs if request.echo else None
        if None not in (request.prompt_logprobs, echo_logprobs) and (
            request.prompt_logprobs != echo_logprobs
        ):
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                "prompt_logprobs must equal logprobs when echo scores the prompt too",
                param="prompt_logprobs",
            )
        if request.stream_options is not None and not request.stream:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                "stream_options is only allowed with stream",
                param="stream_options",
            )

    @staticmethod
    def _check_beam_search(request: CompletionRequest) -> None:
        """Beam search (vLLM's use_beam_search: best_of beams, the n best returned) ranks
        whole sequences, so it has no stream, no per-token logprobs and no stop strings."""
        unsupported = [
            ("stream", request.stream),
            ("logprobs", request.logprobs is not None),
            ("prompt_logprobs", request.prompt_logprobs is not None),
            ("stop", bool(request.stop)),
            ("logit_bias", bool(request.logit_bias)),
            ("allowed_token_ids", request.allowed_token_ids is not None),
            ("bad_words", bool(request.bad_words)),
        ]
        for param, present in unsupported:
            if present:
                raise APIError(
                    HTTPStatus.BAD_REQUEST,
                    f"{param} is not supported with use_beam_search",
                    param=param,
                )
        if request.best_of is not None and request.best_of < request.n:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"best_of ({request.best_of}) must be >= n ({request.n})",
                param="best_of",
            )

    def _process(
        self, request: CompletionRequest, prompt: str | list[int]
    ) -> tuple[ProcessedPrompt, SamplingParams | BeamSearchParams]:
        """Tokenizes and validates one prompt; max_tokens defaults to the room left in the
        context, and a prompt plus max_tokens that overflow the context is a 400."""
        try:
            if request.max_tokens is None:  # validate with a placeholder, then fill the context
                params = self._params(request, max(request.min_tokens, 1))
            else:  # max_tokens 0 (echo): one token is computed, none returned
                params = self._params(request, max(request.max_tokens, 1))
            processed = self.engine.process_inputs(prompt, params)
            room = self.max_model_len - len(processed.token_ids)
            if request.max_tokens is None:
                params = self._params(request, max(room, 1))
                processed = self.engine.process_inputs(processed.token_ids, params)
            elif request.max_tokens > room:
                raise ParameterError(
                    "max_tokens",
                    f"This model's maximum context length is {self.max_model_len} tokens; the "
                    f"prompt has {len(processed.token_ids)} and max_tokens is "
                    f"{request.max_tokens}",
                )
            return ProcessedPrompt(
                prompt if isinstance(prompt, str) else None, processed.token_ids
            ), params
        except ParameterError as exc:
            param = _client_param(request, exc.param)
            raise APIError(HTTPStatus.BAD_REQUEST, str(exc), param=param) from exc

    @staticmethod
    def _params(request: CompletionRequest, max_tokens: int) -> SamplingParams | BeamSearchParams:
        """The engine parameters of a request. A stream takes delta outputs (each event is
        what one or more steps added); a plain response only the final output."""
        if request.use_beam_search:
            try:
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
                )
            except ParameterError as exc:  # name the fields as the client sent them
                raise ParameterError(_client_param(request, exc.param), str(exc)) from exc
        echo_logprobs = request.logprobs if request.echo else None
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
            logprobs=request.logprobs,
            # An echoed prompt's tokens get log-probabilities like the generated ones.
            prompt_logprobs=(
                echo_logprobs if request.prompt_logprobs is None else request.prompt_logprobs
            ),
            logit_bias=_logit_bias(request.logit_bias),
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
        )

    def _submit(
        self,
        request_id: str,
        prompts: list[tuple[ProcessedPrompt, SamplingParams | BeamSearchParams]],
    ) -> list[AsyncIterator[RequestOutput]]:
        arrival = time.monotonic()
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for i, (prompt, params) in enumerate(prompts):
                streams.append(
                    self.engine.add_request(f"{request_id}-{i}", prompt, params, arrival)
                )
        except (QueueFullError, EngineStoppedError) as exc:
            for i in range(len(streams)):
                self.engine.discard(f"{request_id}-{i}")
            raise APIError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                str(exc),
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from exc
        return streams

    # -- responses ---------------------------------------------------------------------------

    async def _complete(self, request_id, request, prompts, streams) -> CompletionResponse:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for index, output in self._merge(streams):
                finals[index] = output
        except Exception as exc:
            raise _engine_error(exc) from exc
        choices = []
        completion_tokens = 0
        for index, final in enumerate(finals):
            assert final is not None and final.finished
            if final.metrics is not None:
                self.metrics.observe_finished(final.metrics)
            for completion in final.outputs:
                delta = self._returned(completion, request)
                completion_tokens += len(delta.token_ids)
                if request.echo:
                    delta = self._with_prompt(final, delta)
                choice_index = index * request.n + completion.index
                choice = self._choice(choice_index, delta, completion, request)
                choice.prompt_logprobs = self._prompt_logprobs(final, request)
                choices.append(choice)
        return CompletionResponse(
            id=request_id,
            model=self.config.served_model_name,
            choices=choices,
            usage=_usage(prompts, completion_tokens),
        )

    async def _stream(self, request_id, request, prompts, streams) -> AsyncIterator[str]:
        """One event per delta output of each choice (the engine holds back text that could
        still turn out to be a stop string), an optional usage event, then [DONE]."""
        # Per choice, where its next token's text starts in its logprobs text (the token
        # texts laid end to end, as in a whole response: held-back text does not shift it).
        text_offsets: dict[int, int] = {}
        completion_tokens = 0
        choice_tokens: dict[int, int] = {}  # completion tokens per choice (continuous usage)
        options = request.stream_options
        include_usage = options is not None and options.include_usage
        continuous_usage = include_usage and options is not None and options.continuous_usage_stats
        created = int(time.time())
        try:
            async for index, output in self._timed(self._merge(streams)):
                for completion in output.outputs:
                    choice_index = index * request.n + completion.index
                    first = choice_index not in text_offsets
                    delta = self._returned(completion, request)
                    completion_tokens += len(delta.token_ids)
                    choice_tokens[choice_index] = choice_tokens.get(choice_index, 0) + len(
                        delta.token_ids
                    )
                    if request.echo and first:
                        delta = self._with_prompt(output, delta)
                    delta.text_offset = text_offsets.get(choice_index, 0)
                    choice = self._choice(choice_index, delta, completion, request)
                    if first:
                        choice.prompt_logprobs = self._prompt_logprobs(output, request)
                    text_offsets[choice_index] = delta.text_offset
                    if choice.logprobs is not None and choice.logprobs.tokens:
                        text_offsets[choice_index] = choice.logprobs.text_offset[-1] + len(
                            choice.logprobs.tokens[-1]
                        )
                    chunk = CompletionResponse(
                        id=request_id,
                        created=created,
                        model=self.config.served_model_name,
                        choices=[choice],
                    )
                    if continuous_usage:
                        prompt_tokens = len(output.prompt_token_ids)
                        chunk.usage = Usage(
                            prompt_tokens=prompt_tokens,
                            completion_tokens=choice_tokens[choice_index],
                            total_tokens=prompt_tokens + choice_tokens[choice_index],
                        )
                    yield sse_event(chunk)
                if output.finished and output.metrics is not None:
                    self.metrics.observe_finished(output.metrics)
            if include_usage:
                yield sse_event(
                    CompletionResponse(
                        id=request_id,
                        created=created,
                        model=self.config.served_model_name,
                        choices=[],
                        usage=_usage(prompts, completion_tokens),
                    )
                )
        except Exception as exc:  # an error event, then [DONE]: never a cut-off stream
            yield sse_event(_engine_error(exc).body())
        yield SSE_DONE

    @staticmethod
    def _returned(completion: CompletionOutput, request: CompletionRequest) -> Delta:
        """What of a completion (output) the client gets: all of it, or nothing when
        max_tokens is 0 (an echoed prompt scored, its computed token dropped)."""
        if request.max_tokens == 0:
            return Delta("", [], [] if request.logprobs is not None else None, 0)
        logprobs = completion.logprobs
        return Delta(
            completion.text, completion.token_ids, None if logprobs is None else [*logprobs], 0
        )

    def _with_prompt(self, output: RequestOutput, delta: Delta) -> Delta:
        """`delta` after the echoed prompt: its text, and its tokens with their
        log-probabilities when asked for (the first prompt token has none)."""
        logprobs = None
        if delta.logprobs is not None:
            prompt = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
            logprobs = [*prompt, *delta.logprobs]
        return Delta(
            self._prompt_text(output) + delta.text,
            [*output.prompt_token_ids, *delta.token_ids],
            logprobs,
            delta.text_offset,
        )

    def _choice(
        self,
        index: int,
        delta: Delta,
        completion: CompletionOutput,
        request: CompletionRequest,
    ) -> CompletionChoice:
        return CompletionChoice(
            index=index,
            text=delta.text,
            logprobs=self._logprobs(delta) if request.logprobs is not None else None,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    async def _timed(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Observes the inter-token latency of each request as its outputs arrive."""
        last: dict[int, float] = {}
        async for index, output in outputs:
            now = time.monotonic()
            if index in last:
                self.metrics.itl.observe(now - last[index])
            last[index] = now
            yield index, output

    @staticmethod
    async def _merge(
        streams: list[AsyncIterator[RequestOutput]],
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Interleaves several output streams as outputs arrive; closing this generator
        (a client that went away) cancels them all, which aborts their requests."""
        if len(streams) == 1:
            async for output in streams[0]:
                yield 0, output
            return
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
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids) if self.tokenizer else ""

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _prompt_logprobs(
        self, output: RequestOutput, request: CompletionRequest
    ) -> list[dict[str, PromptLogprob] | None] | None:
        """vLLM's prompt_logprobs of a choice, when the request asked for them: the prompt
        token with its rank, then the best tokens, ranked 1, 2, ... (skipping the prompt
        token's own rank when it is among them)."""
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
        return PromptLogprob(logprob=entry[token], rank=rank, decoded_token=self._token_text(token))

    def _logprobs(self, delta: Delta) -> Logprobs:
        """OpenAI's per-token lists; a token's text_offset is where its text starts when the
        choice's token texts are laid end to end, from `delta.text_offset`."""
        result = Logprobs()
        offset = delta.text_offset
        for i, token in enumerate(delta.token_ids):
            entry = delta.logprobs[i] if delta.logprobs is not None else {}
            text = self._token_text(token)
            result.tokens.append(text)
            if entry is None:  # the first prompt token: nothing scored it
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                result.token_logprobs.append(entry.get(token))
                result.top_logprobs.append({self._token_text(t): v for t, v in entry.items()})
            result.text_offset.append(offset)
            offset += len(text)
        return result


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


def _client_param(request: CompletionRequest, param: str) -> str:
    """The request field behind an engine parameter: beam_width is best_of when the client
    sent best_of (else n), num_return_sequences is n."""
    if param == "beam_width":
        return "best_of" if request.best_of is not None else "n"
    return {"num_return_sequences": "n"}.get(param, param)


def _engine_error(exc: Exception) -> APIError:
    """What a client is told when its request's outputs end in an exception: the engine is
    stopping (503), the request was refused on admission (400) or failed inside the engine
    while the engine went on serving others (500); anything else is a server bug (500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineStoppedError):
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
    if isinstance(exc, ParameterError):
        return APIError(HTTPStatus.BAD_REQUEST, str(exc), param=exc.param)
    if isinstance(exc, RequestFailedError):
        return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"the request failed: {exc}")
    logger.error("completion failed", exc_info=exc)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(exc).__name__}")


async def _unless_disconnected(raw_request: Request, work: Awaitable[T]) -> T | None:
    """Awaits `work` while listening for the client's disconnect (the body has been read,
    so the next ASGI message is http.disconnect); a disconnect cancels `work` (closing its
    output streams aborts their requests) and returns None."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _usage(
    prompts: list[tuple[ProcessedPrompt, SamplingParams | BeamSearchParams]], completion: int
) -> Usage:
    prompt = sum(len(p.token_ids) for p, _ in prompts)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
