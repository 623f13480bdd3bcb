"""POST /v1/completions: request -> engine requests -> a JSON response or an SSE stream."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from octavo.engine.frontend.outputs import CompletionOutput, RequestOutput
from octavo.server.errors import bad_request
from octavo.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Logprobs,
)
from octavo.server.serving_engine import EngineServing, Generation, PromptAndParams, usage
from octavo.server.stream_builder import ChoiceState, ChunkStream
from octavo.server.stream_chunks import CompletionChunk, CompletionChunkChoice


@dataclass
class Delta:
    """What one event adds to a choice (the engine's delta output, as the client gets it)."""

    text: str
    token_ids: list[int]
    # Per token {token_id: logprob}, the token first; None for a token without any (the
    # first of an echoed prompt). None as a whole when logprobs were not asked for.
    logprobs: list[dict[int, float] | None] | None


class CompletionStream(ChunkStream["CompletionServing", CompletionRequest, CompletionChunk]):
    """A completions stream: one event per delta output of each choice (the engine holds back
    text that could still turn out to be a stop string). A choice's first event carries the
    echoed prompt and the prompt's logprobs when asked for."""

    chunk_type = CompletionChunk

    def delta_events(
        self, output: RequestOutput, completion: CompletionOutput, choice: ChoiceState
    ) -> bytes:
        serving, request = self.serving, self.request
        delta = serving._returned(completion, request)
        choice.tokens += len(delta.token_ids)
        if request.echo and not choice.started:
            delta = serving._with_prompt(output, delta)
        chunk_choice = CompletionChunkChoice(
            index=choice.index,
            text=delta.text,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        if request.logprobs is not None:
            logprobs = chunk_choice.logprobs = serving._logprobs(delta, choice.text_offset)
            if logprobs.tokens:
                choice.text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        if not choice.started:
            chunk_choice.prompt_logprobs = serving.vllm_prompt_logprobs(output, request)
        return self.event(self.chunk([chunk_choice], choice))


class CompletionServing(EngineServing[CompletionRequest]):
    """Converts an OpenAI completion request at the edge and runs it on the AsyncEngine.

    A request with k prompts and n samples becomes k engine requests; choice `i * n + j` is
    sample j of prompt i.
    """

    id_prefix = "cmpl-"
    stream_type = CompletionStream

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        return await self.serve(request, raw_request)

    async def preprocess(self, request: CompletionRequest) -> list[PromptAndParams]:
        self.check_request(request, len(request.prompts()))
        if request.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if request.max_tokens == 0 and not request.echo:
            raise bad_request(
                "max_tokens must be >= 1 (0 only scores an echoed prompt: set echo)",
                param="max_tokens",
            )
        echo_logprobs = request.logprobs if request.echo else None
        if None not in (request.prompt_logprobs, echo_logprobs) and (
            request.prompt_logprobs != echo_logprobs
        ):
            raise bad_request(
                "prompt_logprobs must equal logprobs when echo scores the prompt too",
                param="prompt_logprobs",
            )
        await self.compile_constraint(request)
        return [self.process(request, prompt) for prompt in request.prompts()]

    def response(
        self, generation: Generation[CompletionRequest], finals: list[RequestOutput]
    ) -> CompletionResponse:
        request = generation.request
        choices = []
        completion_tokens = 0
        for index, final in enumerate(finals):
            for completion in final.outputs:
                delta = self._returned(completion, request)
                completion_tokens += len(delta.token_ids)
                if request.echo:
                    delta = self._with_prompt(final, delta)
                choice = CompletionChoice(
                    index=index * request.n + completion.index,
                    text=delta.text,
                    logprobs=self._logprobs(delta) if request.logprobs is not None else None,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    prompt_logprobs=self.vllm_prompt_logprobs(final, request),
                )
                choices.append(choice)
        cached_tokens = sum(final.num_cached_tokens or 0 for final in finals)
        return CompletionResponse(
            id=generation.request_id,
            created=generation.created,
            model=request.model,
            choices=choices,
            usage=usage(generation.prompts, completion_tokens, cached_tokens),
        )

    @staticmethod
    def _returned(completion: CompletionOutput, request: CompletionRequest) -> Delta:
        """What of a completion (output) the client gets: all of it, or nothing when
        max_tokens is 0 (an echoed prompt scored, its computed token dropped)."""
        if request.max_tokens == 0:
            return Delta("", [], [] if request.logprobs is not None else None)
        logprobs = completion.logprobs
        return Delta(
            completion.text, completion.token_ids, None if logprobs is None else [*logprobs]
        )

    def _with_prompt(self, output: RequestOutput, delta: Delta) -> Delta:
        """`delta` after the echoed prompt: its text, and its tokens with their
        log-probabilities when asked for (the first prompt token has none)."""
        logprobs = None
        if delta.logprobs is not None:
            prompt_logprobs = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
            logprobs = [*prompt_logprobs, *delta.logprobs]
        prompt = output.prompt
        if prompt is None:
            prompt = self.tokenizer.decode(output.prompt_token_ids) if self.tokenizer else ""
        return Delta(prompt + delta.text, [*output.prompt_token_ids, *delta.token_ids], logprobs)

    def _logprobs(self, delta: Delta, offset: int = 0) -> Logprobs:
        """OpenAI's per-token lists; a token's text_offset is where its text starts when the
        choice's token texts are laid end to end, from `offset` (where the delta's first
        token's text starts in the choice's)."""
        result = Logprobs()
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
