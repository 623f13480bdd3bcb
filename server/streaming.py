"""Server-sent events framing, and the delta of one choice that an event carries."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

SSE_DONE = "data: [DONE]\n\n"


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
