"""Server-sent events framing, and turning cumulative outputs into stream deltas."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from octavo.engine.outputs import CompletionOutput

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel) -> str:
    """One SSE event: `data: <json>` and a blank line. Every event goes through here."""
    return f"data: {payload.model_dump_json()}\n\n"


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    text_offset: int  # where `text` starts in the choice's full text


class ChoiceStream:
    """Tracks what one choice has already sent and computes the next delta.

    While a choice runs, the last `holdback` characters of its text are withheld: they could
    be the start of a stop string that a later token completes, and a stop string is cut from
    the output, so it must never reach the client. Finished choices flush everything. Every
    step that produced a token yields a delta, with empty text if nothing is ready to show.
    """

    def __init__(self, holdback: int):
        self.holdback = holdback
        self.sent_chars = 0
        self.sent_tokens = 0
        self.finished = False

    def next(self, output: CompletionOutput) -> Delta | None:
        """The new part of `output` (None when nothing is ready to send)."""
        text = output.text
        end = len(text) if output.finished else max(len(text) - self.holdback, self.sent_chars)
        new_tokens = output.token_ids[self.sent_tokens :]
        # A new token is worth a chunk even when its text is held back (as vLLM streams):
        # clients count tokens and time them by chunks.
        if end == self.sent_chars and not new_tokens and not output.finished:
            return None
        delta = Delta(
            text=text[self.sent_chars : end],
            token_ids=new_tokens,
            logprobs=output.logprobs[self.sent_tokens :] if output.logprobs is not None else None,
            text_offset=self.sent_chars,
        )
        self.sent_chars = end
        self.sent_tokens = len(output.token_ids)
        self.finished = output.finished
        return delta
