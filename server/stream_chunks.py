"""The chunks of a streamed response, as msgspec Structs: what every SSE event encodes.

A stream's chunk is built and encoded once per event, so it is a Struct (encoded in well
under a microsecond) rather than a pydantic model (several microseconds: validation on
construction, then its serializer). The fields, their order and their nulls are the
OpenAI shapes the non-streamed responses have (`CompletionResponse` in protocol.py); the
parts only some requests ask for (logprobs, usage, prompt_logprobs) are built as the
pydantic models and carried here as their JSON-ready data (`jsonable`).
"""

from __future__ import annotations

from typing import Any

import msgspec
from pydantic_core import to_jsonable_python

# A nested part as JSON-ready data: a pydantic model (or a list/dict of them) dumped.
Jsonable = Any


def jsonable(value: Any) -> Jsonable:
    """A pydantic model, or lists and dicts of them, as plain JSON-ready data."""
    return to_jsonable_python(value)


class CompletionChunkChoice(msgspec.Struct, kw_only=True, gc=False):
    """A choice of a completions chunk (protocol.CompletionChoice's shape)."""

    index: int
    text: str
    logprobs: Jsonable = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: Jsonable = None


class CompletionChunk(msgspec.Struct, kw_only=True):
    """One event of a completions stream (protocol.CompletionResponse's shape)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Jsonable = None


class ChatDelta(msgspec.Struct, kw_only=True, gc=False):
    """What a chat chunk adds to its choice's message: the role (the first chunk), text,
    and tool-call deltas (OpenAI's streamed shape; the field is left out of chunks that
    have none)."""

    role: str | None = None
    content: str | None = None
    tool_calls: Jsonable | msgspec.UnsetType = msgspec.UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True, gc=False):
    index: int
    delta: ChatDelta
    logprobs: Jsonable = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One event of a chat stream (OpenAI's chat.completion.chunk, with vLLM's
    prompt_logprobs)."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Jsonable = None
    system_fingerprint: str | None = None
    prompt_logprobs: Jsonable = None


Chunk = CompletionChunk | ChatCompletionChunk


class EventEncoder:
    """Frames chunks as SSE events: `data: <json>` and a blank line, as bytes."""

    def __init__(self) -> None:
        self._encoder = msgspec.json.Encoder()

    def event(self, chunk: Chunk) -> bytes:
        return b"data: %s\n\n" % self._encoder.encode(chunk)
