"""Server-sent events framing, and the delta of one choice that an event carries."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = "data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """An SSE response whose event generator is closed however the response ends. Starlette
    leaves a generator it stopped iterating (the client left, the task was cancelled) to the
    garbage collector, and the generator's `finally` is what aborts the request in the
    engine: closing it here makes that abort happen at once."""

    def __init__(self, events: AsyncGenerator[str, None]):
        super().__init__(events, media_type="text/event-stream")
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


def sse_event(payload: BaseModel) -> str:
    """One SSE event: `data: <json>` and a blank line. Every event goes through here."""
    return f"data: {payload.model_dump_json()}\n\n"


@dataclass
class Delta:
    """What one event adds to a choice (the engine's delta output, placed in the choice)."""

    text: str
    token_ids: list[int]
    # Per token {token_id: logprob}, the token first; None for a token without any (the
    # first of an echoed prompt). None as a whole when logprobs were not asked for.
    logprobs: list[dict[int, float] | None] | None
    text_offset: int  # where the first token's text starts in the choice's logprobs text
