"""Tool calling on chat completions: the request's tools, the constraint a forced call is
generated under, and the parsers that turn a choice's text into OpenAI's tool calls.

`tool_choice` decides how a choice's text is read:
- "none": text, as without tools;
- a named function: the text is that function's arguments, generated under its
  `parameters` schema (the structured-outputs grammar), so any model calls it;
- "required": the text is a JSON array of `{"name", "parameters"}` objects, one per call,
  generated under a schema that allows exactly the request's tools (one call unless
  `parallel_tool_calls`), as vLLM forces it;
- "auto": the model decides; a tool-call parser (`--tool-call-parser`, hermes:
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` in the text) finds its calls.

Every parser reads a choice's text as it grows (`feed`) and returns what it adds to the
message: content, and tool-call deltas in OpenAI's streamed shape (an index per call, its
id and name first, then argument fragments that concatenate to the arguments' JSON). A
non-streamed response is the same deltas merged.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from octavo.server.protocol import RequestModel

# At most this many tools a request (their schemas are bounded by the body limit and the
# constraint's compile limits).
MAX_TOOLS = 128
TOOL_CALL_PARSERS = ("hermes",)


class FunctionDefinition(RequestModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any object
    strict: bool | None = None  # arguments always follow the schema when forced


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as generated


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def function_parameters(function: FunctionDefinition) -> dict[str, Any]:
    """The schema a forced call's arguments follow: the function's parameters with every
    object that lists properties closed to others (`additionalProperties: false` where the
    schema does not say), as OpenAI's strict mode requires them. Left open, a grammar lets
    a model that is not trained on the tool add keys without end, the call never ending;
    a schema that wants more keys says so."""
    return {"type": "object"} if function.parameters is None else _closed(function.parameters)


# Keywords whose value is a schema, a list of schemas, or a mapping to schemas.
_SCHEMA_KEYWORDS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _closed(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    if isinstance(closed.get("properties"), dict) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    for key in _SCHEMA_KEYWORDS:
        if key in closed:
            closed[key] = _closed(closed[key])
    for key in _SCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [_closed(item) for item in closed[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: _closed(value) for name, value in closed[key].items()}
    return closed


def forced_schema(
    tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool
) -> dict[str, Any] | None:
    """The JSON schema a forced choice's text follows (None unless tool_choice forces one):
    a named function's parameters, or for "required" an array of calls to the tools."""
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        return function_parameters(next(t.function for t in tools if t.function.name == name))
    if tool_choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": function_parameters(tool.function),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


# -- parsers ----------------------------------------------------------------------------------


@dataclass
class ToolCallDelta:
    """One call's part of a chunk (OpenAI's streamed tool call): its index among the
    choice's calls; id and name in its first delta only; then argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def jsonable(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        delta: dict[str, Any] = {"index": self.index, "function": function}
        if self.id is not None:
            delta["id"] = self.id
            delta["type"] = "function"
        return delta


@dataclass
class MessageDelta:
    """What a choice's message gains from some text: content and tool-call deltas."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser(ABC):
    """Reads one choice's text as it grows."""

    @abstractmethod
    def feed(self, text: str) -> MessageDelta:
        """What `text`, the choice's next text, adds to the message."""

    def finish(self) -> MessageDelta:
        """What the parser still holds once the choice has ended."""
        return MessageDelta()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole text's content (None when empty) and tool calls."""
        deltas = [self.feed(text), self.finish()]
        content = "".join(d.content for d in deltas)
        calls: dict[int, ToolCall] = {}
        for delta in (call for d in deltas for call in d.tool_calls):
            if delta.id is not None:
                calls[delta.index] = ToolCall(
                    id=delta.id, function=FunctionCall(name=delta.name or "", arguments="")
                )
            calls[delta.index].function.arguments += delta.arguments
        return content or None, list(calls.values())


class ContentOnly(ToolCallParser):
    """tool_choice "none" (or no tools): the text is content (an empty one stays "")."""

    def feed(self, text: str) -> MessageDelta:
        return MessageDelta(content=text)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return text, []


class NamedCall(ToolCallParser):
    """A named function forced: the whole text is its arguments."""

    def __init__(self, name: str):
        self.name = name
        self.started = False

    def feed(self, text: str) -> MessageDelta:
        if not self.started:
            self.started = True
            return MessageDelta(tool_calls=[ToolCallDelta(0, tool_call_id(), self.name, text)])
        return MessageDelta(tool_calls=[ToolCallDelta(0, arguments=text)] if text else [])


class RequiredCalls(ToolCallParser):
    """tool_choice "required": the text is `[{"name": ..., "parameters": ...}, ...]` (the
    grammar's schema), scanned as it grows: a call is announced once its name is read,
    and its parameters' JSON text streams as its arguments. A text cut short (max_tokens)
    leaves the calls read so far, the last one's arguments partial."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.token_start = 0  # where the current string started (its opening quote)
        self.expect_key = False
        self.last_key = ""
        self.call = -1
        self.name: str | None = None
        self.args_start: int | None = None  # where the call's parameters start in `text`
        self.args_end: int | None = None  # and end, once they have
        self.args_sent = 0  # of the parameters' text, what has been sent
        self.text = ""

    def feed(self, text: str) -> MessageDelta:
        delta = MessageDelta()
        start = len(self.text)
        self.text += text
        for at in range(start, len(self.text)):
            self._step(at, self.text[at], delta)
        self._send_arguments(len(self.text), delta)
        return delta

    def _step(self, at: int, char: str, delta: MessageDelta) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                if self.depth == 2:
                    value = json.loads(self.text[self.token_start : at + 1])
                    if self.expect_key:
                        self.last_key, self.expect_key = value, False
                    elif self.last_key == "name" and self.name is None:
                        self.name = value
                        delta.tool_calls.append(ToolCallDelta(self.call, tool_call_id(), value))
                        self._send_arguments(at + 1, delta)  # parameters that came first
            return
        if char == '"':
            self.in_string, self.token_start = True, at
            self._maybe_start_arguments(at)
            return
        if char in " \t\n\r":
            return
        if char in "{[":
            self._maybe_start_arguments(at)
            self.depth += 1
            if self.depth == 2:  # a call's object
                self.call += 1
                self.name, self.args_start, self.args_end, self.args_sent = None, None, None, 0
                self.expect_key = True
            return
        if char in "}]":
            self.depth -= 1
            if self.depth == 2 and self.args_start is not None and self.args_end is None:
                self.args_end = at + 1  # the parameters object closed
                self._send_arguments(at + 1, delta)
            return
        if self.depth == 2 and char == ",":
            if self.args_start is not None and self.args_end is None:
                self.args_end = at  # a primitive parameters value ended
                self._send_arguments(at, delta)
            self.expect_key = True
            return
        if self.depth == 2 and char != ":":
            self._maybe_start_arguments(at)

    def _maybe_start_arguments(self, at: int) -> None:
        """A value starting at depth 2 after the "parameters" key is the arguments."""
        at_parameters = self.depth == 2 and not self.expect_key and self.last_key == "parameters"
        if at_parameters and self.args_start is None:
            self.args_start = at

    def _send_arguments(self, end: int, delta: MessageDelta) -> None:
        """Sends the parameters' text up to `end` (once the call's name is known)."""
        if self.args_start is None or self.name is None:
            return
        if self.args_end is not None:
            end = min(end, self.args_end)
        begin = self.args_start + self.args_sent
        if end > begin:
            fragment = self.text[begin:end]
            self.args_sent += len(fragment)
            for call in delta.tool_calls:
                if call.index == self.call:
                    call.arguments += fragment
                    return
            delta.tool_calls.append(ToolCallDelta(self.call, arguments=fragment))


class HermesCalls(ToolCallParser):
    """tool_choice "auto" with the hermes parser: `<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>` blocks in the text are calls, the rest is content. Content streams
    as it comes, except text that may begin a `<tool_call>` tag; a call is sent whole once
    its block closes. A block that is not a valid call, or never closes, is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.pending = ""  # text not yet sent: a possible tag start, or an open block
        self.calls = 0

    def feed(self, text: str) -> MessageDelta:
        delta = MessageDelta()
        self.pending += text
        while True:
            if self.pending.startswith(self.OPEN):
                end = self.pending.find(self.CLOSE)
                if end < 0:
                    return delta
                block = self.pending[: end + len(self.CLOSE)]
                self.pending = self.pending[len(block) :]
                call = self._call(block[len(self.OPEN) : end])
                if call is None:
                    delta.content += block
                else:
                    delta.tool_calls.append(call)
                continue
            at = self.pending.find(self.OPEN)
            if at < 0:
                at = self._possible_tag_start()
            delta.content += self.pending[:at]
            self.pending = self.pending[at:]
            if not self.pending.startswith(self.OPEN):
                return delta

    def finish(self) -> MessageDelta:
        content, self.pending = self.pending, ""
        return MessageDelta(content=content)

    def _possible_tag_start(self) -> int:
        """Where a suffix of `pending` that could grow into the open tag starts."""
        for length in range(min(len(self.OPEN) - 1, len(self.pending)), 0, -1):
            if self.OPEN.startswith(self.pending[-length:]):
                return len(self.pending) - length
        return len(self.pending)

    def _call(self, body: str) -> ToolCallDelta | None:
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, or nested past the recursion limit
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call = ToolCallDelta(self.calls, tool_call_id(), value["name"], arguments)
        self.calls += 1
        return call


def make_parser(
    tool_choice: ToolChoice, has_tools: bool, parser_name: str | None
) -> ToolCallParser:
    """The parser of a request's choices (its tool_choice resolved: see
    ChatCompletionRequest.tool_choice_mode)."""
    if isinstance(tool_choice, NamedToolChoice):
        return NamedCall(tool_choice.function.name)
    if tool_choice == "required":
        return RequiredCalls()
    if tool_choice == "auto" and has_tools and parser_name == "hermes":
        return HermesCalls()
    return ContentOnly()
