"""OpenAI Responses API shapes (pydantic), stateless: the request of POST /v1/responses,
validated at the edge and translated into the chat completion request it amounts to, and the
response object.

The translation is the whole contract: `instructions` is a system message first; `input` (a
string: one user message; or items) is the conversation, where a `function_call` item is an
assistant turn's tool call and a `function_call_output` item the tool's message; flat
function tools, `tool_choice`, `text.format` (structured outputs), `max_output_tokens` and
the sampling fields are the chat fields of the same meaning. So the chat request's checks,
tool forcing and constraints apply unchanged, and a response's text is what
/v1/chat/completions answers for the same conversation. Whatever fails names the Responses
field the client sent (`responses_param`).

Nothing is stored: `store` is accepted and always answered as false, and the fields that
refer to stored state (`previous_response_id`, `conversation`, `prompt`) are a 400 naming
them, as are the others this server cannot honour (`UNSUPPORTED_RESPONSES_FIELDS`).
"""

from __future__ import annotations

import logging
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from octavo.server.chat_protocol import MAX_CHAT_MESSAGES, ChatCompletionRequest
from octavo.server.protocol import (
    PositiveInt,
    Priority,
    RequestModel,
    Seed,
    StructuredOutputsRequest,
    TopK,
    field_error,
    types_only,
    valid_unicode,
)
from octavo.server.tool_calls import MAX_TOOLS, FunctionDefinition

logger = logging.getLogger(__name__)

# OpenAI's bound on metadata: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
# Request fields that need stored state, which a stateless server has none of.
STATEFUL_FIELDS = ("previous_response_id", "conversation", "prompt", "background")
# Request fields this server cannot honour: a 400 names them, unless they ask for nothing
# (null, false, 0, an empty list or object).
UNSUPPORTED_RESPONSES_FIELDS = (
    *STATEFUL_FIELDS,
    # vLLM's carriers of a previous turn (its harmony messages and response).
    "previous_response", "previous_input_messages", "enable_response_messages",
    # Not served on this route: reasoning models' settings, output logprobs (`include`
    # names them), vLLM's extension fields.
    "reasoning", "include", "top_logprobs", "vllm_xargs",
)  # fmt: skip
# The chat request's fields under the names a Responses client sent them by.
RESPONSES_PARAMS = {
    "messages": "input",
    "prompt": "input",  # the rendered conversation
    "continue_final_message": "input",  # a last assistant message still in progress
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}
# Those that error messages name too (not "messages": a common word in a template's errors).
_RENAMED_IN_MESSAGES = re.compile(r"\b(max_tokens|max_completion_tokens|response_format)\b")


def responses_param(param: str | None) -> str | None:
    """The Responses field behind a chat request's field (itself when they share a name)."""
    return None if param is None else RESPONSES_PARAMS.get(param, param)


def responses_message(message: str) -> str:
    """An error message about a chat request, with its field names in Responses terms."""
    return _RENAMED_IN_MESSAGES.sub(lambda match: RESPONSES_PARAMS[match[1]], message)


# -- input items ------------------------------------------------------------------------------


class TextPart(RequestModel):
    """A text content part: input_text (a user's, a tool's), or output_text (an assistant
    message sent back from a previous response; its annotations are not read)."""

    type: Literal["input_text", "output_text"]
    text: str


def _text_parts_only(field: str) -> Any:
    """A before validator: the content parts of `field` are text parts (TextPart)."""
    why = "this model reads text (input_text, output_text)"
    return types_only(field, ("input_text", "output_text"), "content part", why)


def _chat_content(content: str | list[TextPart]) -> str | list[dict[str, str]]:
    """Content as a chat message carries it: text parts are joined by the chat machinery."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


class MessageItem(RequestModel):
    """A message of the conversation (`type` may be left out). An assistant message whose
    status is in_progress or incomplete, last in the input, is continued (as vLLM does)
    rather than answered."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    _parts_are_text = _text_parts_only("content")

    def add_to(self, messages: list[dict[str, Any]]) -> None:
        messages.append({"role": self.role, "content": _chat_content(self.content)})

    @property
    def continued(self) -> bool:
        return self.role == "assistant" and self.status in ("in_progress", "incomplete")


class FunctionCallItem(RequestModel):
    """A call the model made (sent back from a previous response): a tool call of an
    assistant turn, which it joins when it follows an assistant message or call, as a
    model's parallel calls are one turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str

    def add_to(self, messages: list[dict[str, Any]]) -> None:
        call = {
            "id": self.call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


class FunctionCallOutputItem(RequestModel):
    """What a call returned: the tool's message, answering `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    _parts_are_text = _text_parts_only("output")

    def add_to(self, messages: list[dict[str, Any]]) -> None:
        messages.append(
            {"role": "tool", "tool_call_id": self.call_id, "content": _chat_content(self.output)}
        )


def _item_type(value: Any) -> str | None:
    """An input item's tag: its type; "message" when it has none (a role and content)."""
    kind = value.get("type", "message") if isinstance(value, dict) else None
    return kind if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_type,
        custom_error_type="input_item",
        custom_error_message="an input item is a message, a function_call or a "
        "function_call_output: this server stores nothing and reads text",
    ),
]


# -- tools and formats ------------------------------------------------------------------------


class FunctionTool(FunctionDefinition):
    """A function the model may call (the Responses API's flat shape of a chat tool: the
    chat function's fields beside `type`)."""

    type: Literal["function"]

    def chat_tool(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": self.model_dump(exclude={"type"}, exclude_none=True),
        }


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: str


ToolChoice = Literal["none", "auto", "required"] | FunctionToolChoice


class TextFormat(RequestModel):
    """text.format: plain text, any JSON object, or JSON valid against `schema`."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and not self.schema_:
            raise ValueError("a json_schema format needs its schema")
        return self

    def response_format(self) -> dict[str, Any]:
        """The chat request's response_format of the same constraint."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = self.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(RequestModel):
    format: TextFormat | None = None


# -- the request ------------------------------------------------------------------------------


class ResponsesRequest(RequestModel):
    """POST /v1/responses: a conversation (`instructions`, `input`) completed as the
    equivalent chat request (`chat_request`) completes it. Validated strictly, as a chat
    request: a field this server cannot honour is refused by name
    (`UNSUPPORTED_RESPONSES_FIELDS`), truncation other than "disabled" too; other unknown
    fields are ignored with a warning; null means the default."""

    model: str
    input: Annotated[
        Annotated[str, Tag("text")]
        | Annotated[list[InputItem], Field(max_length=MAX_CHAT_MESSAGES), Tag("items")],
        # The errors of the form sent, not of both.
        Discriminator(lambda value: "text" if isinstance(value, str) else "items"),
    ]
    instructions: str | None = None
    # None: up to the context length.
    max_output_tokens: PositiveInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None  # None: false
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    # None: "auto", which with no tools calls none.
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Accepted for clients that set it; nothing is ever stored.
    store: bool | None = None
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA)] | None = None
    # "disabled": a conversation past the context is a 400 (the only mode served).
    truncation: Literal["disabled"] | None = None
    user: str | None = None
    # vLLM's sampling extras, as the chat request takes them.
    priority: Priority | None = None
    seed: Seed | None = None
    top_k: TopK | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    _chat: ChatCompletionRequest = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _unsupported_and_unknown_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in UNSUPPORTED_RESPONSES_FIELDS:
            if data.get(name) not in (None, False, [], {}):  # 0 == False: asks nothing too
                raise field_error(
                    name,
                    "{field} is not supported by this server (it is stateless: nothing is "
                    "stored, so send the whole conversation in input)"
                    if name in STATEFUL_FIELDS
                    else "{field} is not supported by this server yet",
                    "unsupported_field",
                )
        if data.get("truncation") not in (None, "disabled"):
            raise field_error(
                "truncation",
                'only truncation "disabled" is supported: a conversation past the context is a 400',
                "unsupported_field",
            )
        unknown = sorted(k for k in data if k not in cls.model_fields)
        if unknown:
            logger.warning("ignoring unknown ResponsesRequest fields: %s", unknown[:8])
        return data

    _function_tools_only = types_only(
        "tools",
        ("function",),
        "tool",
        "this server calls function tools only (hosted tools run at OpenAI)",
    )

    _valid_unicode = valid_unicode("instructions", "metadata")

    @field_validator("metadata")
    @classmethod
    def _metadata_bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, item in (value or {}).items():
            if len(key) > MAX_METADATA_KEY or len(item) > MAX_METADATA_VALUE:
                raise ValueError(
                    f"metadata keys are at most {MAX_METADATA_KEY} characters and values at "
                    f"most {MAX_METADATA_VALUE}"
                )
        return value

    @model_validator(mode="after")
    def _as_chat(self) -> ResponsesRequest:
        """Builds the chat request; its validation errors name the Responses fields."""
        try:
            self._chat = ChatCompletionRequest.model_validate(self._chat_body())
        except ValidationError as exc:
            first = exc.errors()[0]
            loc, ctx = first.get("loc", ()), first.get("ctx") or {}
            param = str(loc[0]) if loc else ctx.get("field")
            raise PydanticCustomError(
                "chat_request",
                "{message}",
                {"field": responses_param(param), "message": responses_message(first["msg"])},
            ) from None
        return self

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request this request amounts to (one choice: n = 1)."""
        return self._chat

    def _chat_body(self) -> dict[str, Any]:
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        continued = False
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                item.add_to(messages)
            last = self.input[-1] if self.input else None
            continued = isinstance(last, MessageItem) and last.continued
        # A field the chat request has too means the same there (tools and tool_choice differ
        # in shape).
        same = ChatCompletionRequest.model_fields.keys() - {"tools", "tool_choice"}
        body = self.model_dump(include=same, by_alias=True, exclude_none=True)
        translated = {
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "tools": None if self.tools is None else [tool.chat_tool() for tool in self.tools],
            "tool_choice": self._chat_tool_choice(),
            "response_format": self._response_format(),
        }
        body |= {key: value for key, value in translated.items() if value is not None}
        if continued:
            body |= {"add_generation_prompt": False, "continue_final_message": True}
        return body

    def _chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            return {"type": "function", "function": {"name": choice.name}}
        return choice

    def _response_format(self) -> dict[str, Any] | None:
        if self.text is None or self.text.format is None or self.text.format.type == "text":
            return None
        return self.text.format.response_format()

    # -- what the response echoes ------------------------------------------------------------

    def echoed_tool_choice(self) -> str | dict[str, Any]:
        """tool_choice as the response states it: OpenAI's default is "auto"."""
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            return choice.model_dump()
        return choice or "auto"

    def echoed_text(self) -> dict[str, Any]:
        """text as the response states it: plain text unless a format was asked for."""
        if self.text is None or self.text.format is None:
            return {"format": {"type": "text"}}
        return {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def function_call_id() -> str:
    return f"fc_{uuid.uuid4().hex}"


# -- the response -----------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    """The model's text, as one output_text part."""

    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionToolCall(BaseModel):
    """A call the model made: `arguments` is the JSON text generated (partial when the
    response is incomplete)."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[OutputMessage | FunctionToolCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int  # input tokens whose K/V came from the prefix cache
    # OpenAI's count under explicit prompt caching, which this server does not offer.
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponsesResponse(BaseModel):
    """The response object: the request's settings (echoed), its status and output items,
    and the token usage once it has ended."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: None = None
    store: bool = False
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def of(
        cls, request: ResponsesRequest, id_: str, created_at: int, **state: Any
    ) -> ResponsesResponse:
        """The response `id_` to `request`, with `state` (status, output, usage, ...)."""
        chat = request.chat_request()
        return cls(
            id=id_,
            created_at=created_at,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            model=request.model,  # the base's name, or an adapter's
            parallel_tool_calls=chat.parallel_tool_calls,
            temperature=chat.temperature,
            text=request.echoed_text(),
            tool_choice=request.echoed_tool_choice(),
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools or []],
            top_p=chat.top_p,
            user=request.user,
            metadata=request.metadata or {},
            **state,
        )
