"""POST /v1/completions: request -> engine requests -> a JSON response or an SSE stream."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from http import HTTPStatus

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from octavo.engine.frontend.outputs import CompletionOutput, RequestOutput
from octavo.server.errors import APIError
from octavo.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Logprobs,
    Usage,
    completion_id,
)
from octavo.server.serving_engine import (
    EngineServing,
    PromptAndParams,
    engine_error,
    json_unless_disconnected,
    usage,
)
from octavo.server.stream_chunks import CompletionChunk, CompletionChunkChoice, jsonable
from octavo.server.streaming import SSE_DONE, Delta, EventStreamResponse, sse_event


class CompletionServing(EngineServing):
    """Converts an OpenAI completion request at the edge and runs it on the AsyncEngine.

    A request with k prompts and n samples becomes k engine requests; choice `i * n + j` is
    sample j of prompt i.
    """

    async def create(
        self, request: CompletionRequest, raw_request: Request
    ) -> JSONResponse | EventStreamResponse | Response:
        """The response to one completion request. A non-streaming request whose client
        disconnects (`raw_request` says so) is aborted like a stream whose client left."""
        self._check_supported(request)
        await self.compile_constraint(request)
        prompts = [self.process(request, p) for p in request.prompts()]
        request_id = completion_id()
        streams = self.submit(request_id, prompts)
        if request.stream:
            body = self._stream(request_id, request, prompts, streams)
            return EventStreamResponse(body)
        completion = self._complete(request_id, request, prompts, streams)
        return await json_unless_disconnected(raw_request, completion)

    # -- validation --------------------------------------------------------------------------

    def _check_supported(self, request: CompletionRequest) -> None:
        self.check_request(request, len(request.prompts()))
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

    # -- responses ---------------------------------------------------------------------------

    async def _complete(
        self,
        request_id: str,
        request: CompletionRequest,
        prompts: list[PromptAndParams],
        streams: list[AsyncIterator[RequestOutput]],
    ) -> CompletionResponse:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for index, output in self.merge(streams):
                finals[index] = output
        except Exception as exc:
            raise engine_error(exc) from exc
        choices = []
        completion_tokens = cached_tokens = 0
        for index, final in enumerate(finals):
            assert final is not None and final.finished
            cached_tokens += final.num_cached_tokens or 0
            if final.metrics is not None:
                self.metrics.observe_finished(final.metrics)
            for completion in final.outputs:
                delta = self._returned(completion, request)
                completion_tokens += len(delta.token_ids)
                if request.echo:
                    delta = self._with_prompt(final, delta)
                choice_index = index * request.n + completion.index
                choice = self._choice(choice_index, delta, completion, request)
                choice.prompt_logprobs = self.vllm_prompt_logprobs(final, request)
                choices.append(choice)
        return CompletionResponse(
            id=request_id,
            model=self.config.served_model_name,
            choices=choices,
            usage=usage(prompts, completion_tokens, cached_tokens),
        )

    async def _stream(
        self,
        request_id: str,
        request: CompletionRequest,
        prompts: list[PromptAndParams],
        streams: list[AsyncIterator[RequestOutput]],
    ) -> AsyncGenerator[bytes, None]:
        """One event per delta output of each choice (the engine holds back text that could
        still turn out to be a stop string), an optional usage event, then [DONE]. The
        events of one output leave together, as do the usage event and [DONE]."""
        # Per choice, where its next token's text starts in its logprobs text (the token
        # texts laid end to end, as in a whole response: held-back text does not shift it).
        text_offsets: dict[int, int] = {}
        completion_tokens = 0
        choice_tokens: dict[int, int] = {}  # completion tokens per choice (continuous usage)
        cached_tokens: dict[int, int] = {}  # per prompt, from the prefix cache
        options = request.stream_options
        include_usage = options is not None and options.include_usage
        continuous_usage = include_usage and options is not None and options.continuous_usage_stats
        created = int(time.time())
        model = self.config.served_model_name
        event = self.events.event
        # Per choice, once its first event is out, the events that carry only its next text
        # (EventEncoder.text_events): a request that asked for no logprobs and no continuous
        # usage, until the choice's finish.
        plain = request.logprobs is None and not continuous_usage and request.max_tokens != 0
        text_events: dict[int, Callable[[str], bytes]] = {}
        try:
            async for index, output in self.merge(streams):
                if output.num_cached_tokens is not None:
                    cached_tokens[index] = output.num_cached_tokens
                events = []
                for completion in output.outputs:
                    choice_index = index * request.n + completion.index
                    text_event = text_events.get(choice_index)
                    if text_event is not None and completion.finish_reason is None:
                        completion_tokens += len(completion.token_ids)
                        events.append(text_event(completion.text))
                        continue
                    first = choice_index not in text_offsets
                    delta = self._returned(completion, request)
                    completion_tokens += len(delta.token_ids)
                    choice_tokens[choice_index] = choice_tokens.get(choice_index, 0) + len(
                        delta.token_ids
                    )
                    if request.echo and first:
                        delta = self._with_prompt(output, delta)
                    delta.text_offset = text_offsets.get(choice_index, 0)
                    text_offsets[choice_index] = delta.text_offset
                    choice = CompletionChunkChoice(
                        index=choice_index,
                        text=delta.text,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                    if request.logprobs is not None:
                        logprobs = self._logprobs(delta)
                        choice.logprobs = jsonable(logprobs)
                        if logprobs.tokens:
                            text_offsets[choice_index] = logprobs.text_offset[-1] + len(
                                logprobs.tokens[-1]
                            )
                    if first:
                        choice.prompt_logprobs = jsonable(
                            self.vllm_prompt_logprobs(output, request)
                        )
                    chunk = CompletionChunk(
                        id=request_id, created=created, model=model, choices=[choice]
                    )
                    if continuous_usage:
                        prompt_tokens = len(output.prompt_token_ids)
                        chunk.usage = jsonable(
                            Usage(
                                prompt_tokens=prompt_tokens,
                                completion_tokens=choice_tokens[choice_index],
                                total_tokens=prompt_tokens + choice_tokens[choice_index],
                            )
                        )
                    events.append(event(chunk))
                    if plain and first and completion.finish_reason is None:
                        text_events[choice_index] = self.events.text_events(
                            functools.partial(self._text_chunk, request_id, created, choice_index)
                        )
                if output.finished and output.metrics is not None:
                    self.metrics.observe_finished(output.metrics)
                if events:
                    yield b"".join(events)
            if include_usage:
                total = usage(prompts, completion_tokens, sum(cached_tokens.values()))
                chunk = CompletionChunk(
                    id=request_id, created=created, model=model, choices=[], usage=jsonable(total)
                )
                yield event(chunk) + SSE_DONE
                return
        except Exception as exc:  # an error event, then [DONE]: never a cut-off stream
            yield sse_event(engine_error(exc).body()) + SSE_DONE
            return
        yield SSE_DONE

    def _text_chunk(self, request_id: str, created: int, index: int, text: str) -> CompletionChunk:
        """The chunk of an event that carries only choice `index`'s next text."""
        choice = CompletionChunkChoice(index=index, text=text)
        return CompletionChunk(
            id=request_id, created=created, model=self.config.served_model_name, choices=[choice]
        )

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

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids) if self.tokenizer else ""

    def _logprobs(self, delta: Delta) -> Logprobs:
        """OpenAI's per-token lists; a token's text_offset is where its text starts when the
        choice's token texts are laid end to end, from `delta.text_offset`."""
        result = Logprobs()
        offset = delta.text_offset
        for i, token in enumerate(delta.token_ids):
            entry = delta.logprobs[i] if delta.logprobs is not None else {}
            text = self.token_text(token)
            result.tokens.append(text)
            if entry is None:  # the first prompt token: nothing scored it
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                result.token_logprobs.append(entry.get(token))
                result.top_logprobs.append({self.token_text(t): v for t, v in entry.items()})
            result.text_offset.append(offset)
            offset += len(text)
        return result
