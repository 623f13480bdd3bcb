"""POST /v1/chat/completions: a conversation rendered by the chat template, completed by the
engine, answered as a chat.completion or a stream of chat.completion.chunk events."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from http import HTTPStatus

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from octavo.engine.errors import ParameterError
from octavo.engine.frontend.outputs import CompletionOutput, RequestOutput
from octavo.server.chat_protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    TokenLogprob,
    TopLogprob,
    chat_completion_id,
)
from octavo.server.chat_template import ChatTemplate
from octavo.server.errors import APIError
from octavo.server.protocol import Usage
from octavo.server.serving_engine import (
    EngineServing,
    PromptAndParams,
    engine_error,
    json_unless_disconnected,
    usage,
)
from octavo.server.stream_chunks import ChatChunkChoice, ChatCompletionChunk, ChatDelta, jsonable
from octavo.server.streaming import SSE_DONE, EventStreamResponse, sse_event

# Template variables a request's chat_template_kwargs may not set: the server sets them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt"})


class ChatServing(EngineServing):
    """A chat request is one prompt (the rendered conversation) with n samples: one engine
    request, whose sample j is choice j."""

    async def create(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> JSONResponse | EventStreamResponse | Response:
        """The response to one chat request; a non-streaming request whose client
        disconnects is aborted like a stream whose client left."""
        template = self.config.chat_template
        if template is None:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                "this model has no chat template, so it cannot serve chat requests: start the "
                "server with --chat-template FILE_OR_STRING (a Jinja chat template), or use "
                "/v1/completions",
            )
        self._check_supported(request)
        await self.compile_constraint(request)
        prompts = [self.process(request, self._render(template, request))]
        request_id = chat_completion_id()
        streams = self.submit(request_id, prompts)
        if request.stream:
            body = self._stream(request_id, request, prompts, streams)
            return EventStreamResponse(body)
        completion = self._complete(request_id, request, prompts, streams)
        return await json_unless_disconnected(raw_request, completion)

    def _check_supported(self, request: ChatCompletionRequest) -> None:
        self.check_request(request, num_prompts=1)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                "top_logprobs is only allowed with logprobs: true",
                param="top_logprobs",
            )
        if request.continue_final_message and request.add_generation_prompt:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                "continue_final_message continues the last message: it needs "
                "add_generation_prompt: false",
                param="continue_final_message",
            )
        reserved = RESERVED_TEMPLATE_VARIABLES & (request.chat_template_kwargs or {}).keys()
        if reserved:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"chat_template_kwargs may not set {sorted(reserved)}: they are request fields",
                param="chat_template_kwargs",
            )

    @staticmethod
    def _render(template: ChatTemplate, request: ChatCompletionRequest) -> str:
        """The prompt of a conversation. With continue_final_message it ends where the last
        message's text ends (whatever the template closes the turn with is cut off), so the
        model continues that message."""
        messages = [message.for_template() for message in request.messages]
        try:
            prompt = template.render(
                messages, request.add_generation_prompt, **(request.chat_template_kwargs or {})
            )
        except ParameterError as exc:
            raise APIError(HTTPStatus.BAD_REQUEST, str(exc), param=exc.param) from exc
        final = request.messages[-1].text()
        if request.continue_final_message and final:
            end = prompt.rfind(final)
            if end < 0:
                raise APIError(
                    HTTPStatus.BAD_REQUEST,
                    "continue_final_message: the chat template does not reproduce the final "
                    "message's text, so there is nothing to continue",
                    param="continue_final_message",
                )
            prompt = prompt[: end + len(final)]
        return prompt

    # -- responses ---------------------------------------------------------------------------

    async def _complete(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        prompts: list[PromptAndParams],
        streams: list[AsyncIterator[RequestOutput]],
    ) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        try:
            async for _, output in self.merge(streams):
                final = output
        except Exception as exc:
            raise engine_error(exc) from exc
        assert final is not None and final.finished
        if final.metrics is not None:
            self.metrics.observe_finished(final.metrics)
        choices = [
            ChatCompletionChoice(
                index=completion.index,
                message=AssistantMessage(content=completion.text),
                logprobs=self._logprobs(completion, request),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            for completion in final.outputs
        ]
        return ChatCompletionResponse(
            id=request_id,
            model=self.config.served_model_name,
            choices=choices,
            usage=usage(
                prompts,
                sum(len(c.token_ids) for c in final.outputs),
                final.num_cached_tokens or 0,
            ),
            prompt_logprobs=self.vllm_prompt_logprobs(final, request),
        )

    async def _stream(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        prompts: list[PromptAndParams],
        streams: list[AsyncIterator[RequestOutput]],
    ) -> AsyncGenerator[bytes, None]:
        """As OpenAI: each choice's first chunk carries the role; then one chunk per delta
        output of a choice (the last with its finish_reason); an optional usage chunk; then
        [DONE]. The chunks of one output leave together, as do the usage chunk and [DONE]."""
        created = int(time.time())
        model = self.config.served_model_name
        event = self.events.event
        options = request.stream_options
        include_usage = options is not None and options.include_usage
        continuous_usage = include_usage and options is not None and options.continuous_usage_stats
        prompt_tokens = len(prompts[0][0].token_ids)
        completion_tokens = [0] * request.n
        roles = [
            ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))
            for index in range(request.n)
        ]
        yield b"".join(
            event(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[r]))
            for r in roles
        )
        first = True
        cached_tokens = 0  # prompt tokens found in the prefix cache
        # Per choice, once its first event is out, the events that carry only its next text
        # (EventEncoder.text_events): a request that asked for no logprobs and no continuous
        # usage, until the choice's finish.
        plain = not request.logprobs and not continuous_usage
        text_events: dict[int, Callable[[str], bytes]] = {}
        try:
            async for _, output in self.merge(streams):
                if output.num_cached_tokens is not None:
                    cached_tokens = output.num_cached_tokens
                events = []
                for completion in output.outputs:
                    completion_tokens[completion.index] += len(completion.token_ids)
                    text_event = text_events.get(completion.index)
                    if text_event is not None and completion.finish_reason is None:
                        events.append(text_event(completion.text))
                        continue
                    choice = ChatChunkChoice(
                        index=completion.index,
                        delta=ChatDelta(content=completion.text),
                        logprobs=jsonable(self._logprobs(completion, request)),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                    chunk = ChatCompletionChunk(
                        id=request_id, created=created, model=model, choices=[choice]
                    )
                    if first:  # the prompt's logprobs come once, with the first output
                        chunk.prompt_logprobs = jsonable(self.vllm_prompt_logprobs(output, request))
                        first = False
                    if continuous_usage:
                        generated = completion_tokens[completion.index]
                        chunk.usage = jsonable(
                            Usage(
                                prompt_tokens=prompt_tokens,
                                completion_tokens=generated,
                                total_tokens=prompt_tokens + generated,
                            )
                        )
                    events.append(event(chunk))
                    if plain and completion.finish_reason is None:
                        text_events[completion.index] = self.events.text_events(
                            functools.partial(
                                self._text_chunk, request_id, created, completion.index
                            )
                        )
                if output.finished and output.metrics is not None:
                    self.metrics.observe_finished(output.metrics)
                if events:
                    yield b"".join(events)
            if include_usage:
                total = usage(prompts, sum(completion_tokens), cached_tokens)
                chunk = ChatCompletionChunk(
                    id=request_id, created=created, model=model, choices=[], usage=jsonable(total)
                )
                yield event(chunk) + SSE_DONE
                return
        except Exception as exc:  # an error event, then [DONE]: never a cut-off stream
            yield sse_event(engine_error(exc).body()) + SSE_DONE
            return
        yield SSE_DONE

    def _text_chunk(
        self, request_id: str, created: int, index: int, text: str
    ) -> ChatCompletionChunk:
        """The chunk of an event that carries only choice `index`'s next text."""
        choice = ChatChunkChoice(index=index, delta=ChatDelta(content=text))
        return ChatCompletionChunk(
            id=request_id, created=created, model=self.config.served_model_name, choices=[choice]
        )

    def _logprobs(
        self, completion: CompletionOutput, request: ChatCompletionRequest
    ) -> ChatLogprobs | None:
        """The chat shape of a completion's log-probabilities: per token its own and the
        top_logprobs best, most likely first."""
        if not request.logprobs or completion.logprobs is None:
            return None
        top = request.top_logprobs or 0
        content = []
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            best = list(entry.items())
            if len(best) > top:  # the sampled token (first) is not among the best
                best = best[1:]
            best.sort(key=lambda item: item[1], reverse=True)
            content.append(
                TokenLogprob(
                    **self._top_logprob(token, entry[token]).model_dump(),
                    top_logprobs=[self._top_logprob(t, value) for t, value in best],
                )
            )
        return ChatLogprobs(content=content)

    def _top_logprob(self, token: int, logprob: float) -> TopLogprob:
        token_bytes = None if self.tokenizer is None else list(self.tokenizer.token_bytes(token))
        return TopLogprob(token=self.token_text(token), logprob=logprob, bytes=token_bytes)
