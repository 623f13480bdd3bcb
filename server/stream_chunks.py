"""The chunks of a streamed completion or chat completion, as msgspec Structs: what every
SSE event of those streams encodes (`streaming.EventEncoder`).

A stream's chunk is built and encoded once per event, so it is a Struct (encoded in well
under a microsecond) rather than a pydantic model (several microseconds: validation on
construction, then its serializer). The fields, their order and their nulls are the
OpenAI shapes the non-streamed responses have (`CompletionResponse` in protocol.py); the
parts only some requests ask for (logprobs, usage, prompt_logprobs) are the pydantic models
of those responses, which the encoder writes as their JSON-ready data.
"""

from __future__ import annotations

from typing import Any

import msgspec

# A nested part: a pydantic model, a list or dict of them, or None.
Part = Any


class CompletionChunkChoice(msgspec.Struct, kw_only=True, gc=False):
    """A choice of a completions chunk (protocol.CompletionChoice's shape)."""

    index: int
    text: str
    logprobs: Part = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: Part = None


class CompletionChunk(msgspec.Struct, kw_only=True):
    """One event of a completions stream (protocol.CompletionResponse's shape)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Part = None


class ChatDelta(msgspec.Struct, kw_only=True, gc=False):
    """What a chat chunk adds to its choice's message: the role (the first chunk), text,
    and tool-call deltas (OpenAI's streamed shape; the field is left out of chunks that
    have none)."""

    role: str | None = None
    content: str | None = None
    tool_calls: Part | msgspec.UnsetType = msgspec.UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True, gc=False):
    index: int
    delta: ChatDelta
    logprobs: Part = None
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
    usage: Part = None
    system_fingerprint: str | None = None
    prompt_logprobs: Part = None
