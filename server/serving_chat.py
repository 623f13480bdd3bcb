"""POST /v1/chat/completions: a conversation rendered by the chat template, completed by the
engine, answered as a chat.completion or a stream of chat.completion.chunk events."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response

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
)
from octavo.server.chat_template import ChatTemplate
from octavo.server.errors import bad_request
from octavo.server.serving_engine import EngineServing, Generation, PromptAndParams, usage
from octavo.server.stream_builder import ChoiceState, ChunkStream
from octavo.server.stream_chunks import ChatChunkChoice, ChatCompletionChunk, ChatDelta
from octavo.server.tool_calls import ToolCallParser, make_parser

# Template variables a request's chat_template_kwargs may not set: the server sets them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools"})


class ChatStream(ChunkStream["ChatServing", ChatCompletionRequest, ChatCompletionChunk]):
    """A chat stream, as OpenAI's: each choice's first chunk carries the role, then one chunk
    per delta output of a choice, the last with its finish_reason. The prompt's logprobs,
    when asked for, come once, with the first output. With tools, each choice's text goes
    through its tool-call parser: a chunk carries the content and tool-call deltas it
    released."""

    chunk_type = ChatCompletionChunk

    def __init__(self, *args: Any):
        super().__init__(*args)
        self._prompt_scored = False  # whether the prompt's logprobs are out
        # Each choice's tool-call parser: only a request with tools reads its text through one.
        parsers = range(self.n) if self.request.tools else ()
        self._parsers = [self.serving.tool_parser(self.request) for _ in parsers]
        self._called: set[int] = set()  # the choices that called a tool

    def opening(self) -> bytes:
        role = ChatDelta(role="assistant", content="")
        return b"".join(
            self.event(self.chunk([ChatChunkChoice(index=index, delta=role)]))
            for index in range(self.n)
        )

    def delta_events(
        self, output: RequestOutput, completion: CompletionOutput, choice: ChoiceState
    ) -> bytes:
        serving, request = self.serving, self.request
        choice.tokens += len(completion.token_ids)
        delta = ChatDelta(content=completion.text)
        reason = completion.finish_reason
        if request.tools:
            delta, reason = self._tool_delta(completion, choice.index)
        chunk_choice = ChatChunkChoice(
            index=choice.index,
            delta=delta,
            logprobs=serving._logprobs(completion, request),
            finish_reason=reason,
            stop_reason=completion.stop_reason,
        )
        chunk = self.chunk([chunk_choice], choice)
        if not self._prompt_scored:
            chunk.prompt_logprobs = serving.vllm_prompt_logprobs(output, request)
            self._prompt_scored = True
        return self.event(chunk)

    def _tool_delta(self, completion: CompletionOutput, index: int) -> tuple[ChatDelta, str | None]:
        """The delta and finish_reason of a choice's output read by its tool-call parser."""
        parser = self._parsers[index]
        parts = [parser.feed(completion.text)]
        if completion.finish_reason is not None:
            parts.append(parser.finish())
        calls = [call.jsonable() for part in parts for call in part.tool_calls]
        if calls:
            self._called.add(index)
        content = "".join(part.content for part in parts)
        delta = ChatDelta(content=content or None, tool_calls=calls or msgspec.UNSET)
        return delta, finish_reason(completion.finish_reason, index in self._called)


class ChatServing(EngineServing[ChatCompletionRequest]):
    """A chat request is one prompt (the rendered conversation) with n samples: one engine
    request, whose sample j is choice j."""

    id_prefix = "chatcmpl-"
    stream_type = ChatStream

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await self.serve(request, raw_request)

    async def preprocess(
        self, request: ChatCompletionRequest, route: str = "chat requests"
    ) -> list[PromptAndParams]:
        """`route` names what a server without a chat template refuses (a 400)."""
        template = self.config.chat_template
        if template is None:
            raise bad_request(
                f"this model has no chat template, so it cannot serve {route}: start the server "
                "with --chat-template FILE_OR_STRING (a Jinja chat template), or use "
                "/v1/completions"
            )
        self.check_request(request, num_prompts=1)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request(
                "top_logprobs is only allowed with logprobs: true", param="top_logprobs"
            )
        if request.continue_final_message and request.add_generation_prompt:
            raise bad_request(
                "continue_final_message continues the last message: it needs "
                "add_generation_prompt: false",
                param="continue_final_message",
            )
        if (
            request.tools
            and request.tool_choice_mode == "auto"
            and not self.config.tool_call_parser
        ):
            raise bad_request(
                '"auto" tool choice (the default with tools) needs the server started with '
                "--enable-auto-tool-choice and --tool-call-parser; a named function or "
                '"required" works without them',
                param="tool_choice",
            )
        reserved = RESERVED_TEMPLATE_VARIABLES & (request.chat_template_kwargs or {}).keys()
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {sorted(reserved)}: they are request fields",
                param="chat_template_kwargs",
            )
        await self.compile_constraint(request)
        return [self.process(request, self._render(template, request))]

    @staticmethod
    def _render(template: ChatTemplate, request: ChatCompletionRequest) -> str:
        """The prompt of a conversation. With continue_final_message it ends where the last
        message's text ends (whatever the template closes the turn with is cut off), so the
        model continues that message."""
        messages = [message.for_template() for message in request.messages]
        variables = dict(request.chat_template_kwargs or {})
        if request.tools:  # as transformers' apply_chat_template(tools=...) passes them
            variables["tools"] = [tool.model_dump(exclude_none=True) for tool in request.tools]
        try:
            prompt = template.render(messages, request.add_generation_prompt, **variables)
        except ParameterError as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        final = request.messages[-1].text()
        if request.continue_final_message and final:
            end = prompt.rfind(final)
            if end < 0:
                raise bad_request(
                    "continue_final_message: the chat template does not reproduce the final "
                    "message's text, so there is nothing to continue",
                    param="continue_final_message",
                )
            prompt = prompt[: end + len(final)]
        return prompt

    def response(
        self, generation: Generation[ChatCompletionRequest], finals: list[RequestOutput]
    ) -> ChatCompletionResponse:
        request = generation.request
        [final] = finals
        choices = []
        for completion in final.outputs:
            content, tool_calls = self.tool_parser(request).parse(completion.text)
            choices.append(
                ChatCompletionChoice(
                    index=completion.index,
                    message=AssistantMessage(content=content, tool_calls=tool_calls),
                    logprobs=self._logprobs(completion, request),
                    finish_reason=finish_reason(completion.finish_reason, bool(tool_calls)),
                    stop_reason=completion.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=generation.request_id,
            created=generation.created,
            model=request.model,
            choices=choices,
            usage=usage(
                generation.prompts,
                sum(len(c.token_ids) for c in final.outputs),
                final.num_cached_tokens or 0,
            ),
            prompt_logprobs=self.vllm_prompt_logprobs(final, request),
        )

    def tool_parser(self, request: ChatCompletionRequest) -> ToolCallParser:
        """A new parser of one choice's text, by the request's tool_choice."""
        return make_parser(
            request.tool_choice_mode, bool(request.tools), self.config.tool_call_parser
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


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice's finish_reason: "tool_calls" where it called tools and ended by itself."""
    return "tool_calls" if called and reason == "stop" else reason
