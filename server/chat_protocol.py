"""OpenAI chat completions API shapes (pydantic): the request, validated at the edge like a
completion request, and the response and stream chunk."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from octavo.engine.structured_outputs import StructuredOutputsParams
from octavo.server.protocol import (
    UNSUPPORTED_VLLM_FIELDS,
    GenerationRequest,
    LogprobsCount,
    PositiveInt,
    PromptLogprob,
    RequestModel,
    Usage,
    check_unicode,
    field_error,
    types_only,
    valid_unicode,
)
from octavo.server.tool_calls import (
    MAX_TOOLS,
    ChatTool,
    NamedToolChoice,
    ToolCall,
    ToolChoice,
    forced_schema,
)

# Bounds on a conversation, checked before the template runs (the body limit bounds bytes).
MAX_CHAT_MESSAGES = 1024
MAX_TEMPLATE_KWARGS = 64
# A chat request's fields that this server cannot honour: a 400 names them.
UNSUPPORTED_CHAT_FIELDS = (
    *UNSUPPORTED_VLLM_FIELDS,
    "functions", "function_call", "audio", "prediction", "web_search_options",
    # vLLM's chat extras: a request-supplied template (only the server's is trusted), RAG
    # documents for the template, and echo of the last message.
    "chat_template", "documents", "echo",
)  # fmt: skip


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    """One message of a conversation. Content is a string, text parts (joined with newlines
    for the template, as vLLM's "string" content format), or null (an assistant turn with
    tool calls). An assistant's `tool_calls` are OpenAI's: a list of function calls, each
    with its arguments as JSON text. Other fields (`name`, `tool_call_id`, ...) reach the
    template as sent."""

    model_config = ConfigDict(extra="allow")

    role: Annotated[str, Field(min_length=1)]
    content: str | list[TextContentPart] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None

    _text_parts_only = types_only("content", ("text",), "content part", "this model reads text")

    @model_validator(mode="after")
    def _valid_unicode(self) -> ChatMessage:
        check_unicode(self, "messages")
        return self

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it: role, text content, and the rest. An
        assistant's tool calls carry their arguments parsed, as templates written for
        transformers expect them (OpenAI sends them as JSON text)."""
        message = {**(self.model_extra or {}), "role": self.role, "content": self.text()}
        if self.tool_calls is not None:
            message["tool_calls"] = [_parsed_arguments(call) for call in self.tool_calls]
        return message


def _parsed_arguments(call: ToolCall) -> dict[str, Any]:
    """A call as templates read it: its arguments an object where their text is JSON."""
    arguments: Any = call.function.arguments
    # Text that is not JSON (or nests past Python's recursion limit) stays text.
    with contextlib.suppress(ValueError, RecursionError):
        arguments = json.loads(arguments)
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": call.type, "function": function}


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions: a conversation, rendered by the server's chat template into
    one prompt that is completed like a completion request's."""

    UNSUPPORTED: ClassVar[tuple[str, ...]] = UNSUPPORTED_CHAT_FIELDS

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)]
    # max_tokens is OpenAI's deprecated name of max_completion_tokens; None: up to the context.
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: LogprobsCount | None = None
    # vLLM's: open an assistant turn (the default), or continue the final message instead.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: (
        Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None
    ) = None
    # OpenAI's tool calling (server/tool_calls.py); tool_choice None: "auto" with tools,
    # else "none".
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    _kwargs_unicode = valid_unicode("chat_template_kwargs", "tools")

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) < len(names):
            raise field_error("tools", "function names must be unique, got {names}", names=names)
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise field_error(
                "tool_choice",
                "the function {name} is not among the request's tools",
                name=repr(choice.function.name),
            )
        if choice == "required" and not names:
            raise field_error("tool_choice", '"required" needs tools to choose from')
        return self

    @property
    def tool_choice_mode(self) -> ToolChoice:
        """tool_choice as it applies: its default is "auto" with tools, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def constraint_fields(self) -> list[str]:
        """The base's, and "tools" when tool_choice forces a call (the tools' schema is the
        constraint then)."""
        given = super().constraint_fields
        if self.tools and self._forces_call:
            given.append("tools")
        return given

    @property
    def _forces_call(self) -> bool:
        return isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        if not (self.tools and self._forces_call):
            return super().structured_outputs_params()
        assert self.tool_choice is not None
        schema = forced_schema(self.tools, self.tool_choice, self.parallel_tool_calls)
        return StructuredOutputsParams(json=schema)

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens  # both positive when set

    def sample_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def client_param(self, param: str) -> str:
        if param == "prompt":  # the rendered conversation
            return "messages"
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if param == "logprobs" and self.top_logprobs is not None:
            return "top_logprobs"
        return super().client_param(param)


class TopLogprob(BaseModel):
    """A token's log-probability in the chat shape: its text and its bytes (a token may be
    part of a UTF-8 character; the bytes of a choice's tokens concatenate to its text)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None
    # vLLM's: the rendered prompt's logprobs when the request set prompt_logprobs.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
