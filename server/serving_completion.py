"""POST /v1/completions: request -> engine requests -> a JSON response or an SSE stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
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
    completion_id,
)
from octavo.server.serving_engine import (
    EngineServing,
    PromptAndParams,
    engine_error,
    json_unless_disconnected,
    usage,
)
from octavo.server.stream_builder import ChoiceState, StreamBuilder
from octavo.server.stream_chunks import CompletionChunk, CompletionChunkChoice, jsonable
from octavo.server.streaming import Delta, EventStreamResponse


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
        streams = self.submit(request_id, prompts, request.model)
        if request.stream:
            builder = CompletionStream(self, request_id, request, prompts)
            return EventStreamResponse(builder.events(self.merge(streams)))
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
            model=request.model,
            choices=choices,
            usage=usage(prompts, completion_tokens, cached_tokens),
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


class CompletionStream(StreamBuilder[CompletionServing, CompletionRequest, CompletionChunk]):
    """A completions stream: one event per delta output of each choice (the engine holds back
    text that could still turn out to be a stop string). A choice's first event carries the
    echoed prompt and the prompt's logprobs when asked for."""

    chunk_type = CompletionChunk

    def delta_chunk(
        self, output: RequestOutput, completion: CompletionOutput, choice: ChoiceState
    ) -> CompletionChunk:
        serving, request = self.serving, self.request
        delta = serving._returned(completion, request)
        choice.tokens += len(delta.token_ids)
        if request.echo and not choice.started:
            delta = serving._with_prompt(output, delta)
        delta.text_offset = choice.text_offset
        chunk_choice = CompletionChunkChoice(
            index=choice.index,
            text=delta.text,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        if request.logprobs is not None:
            logprobs = serving._logprobs(delta)
            chunk_choice.logprobs = jsonable(logprobs)
            if logprobs.tokens:
                choice.text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        if not choice.started:
            chunk_choice.prompt_logprobs = jsonable(serving.vllm_prompt_logprobs(output, request))
        return self.chunk([chunk_choice])
