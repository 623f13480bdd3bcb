"""Stop strings, matched on the front end beside the detokenizer (the core knows no text)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopStringMatch:
    """A stop string found in a sample's text: `stop` ends the sample (its stop_reason), and
    the text is cut at `text_end` (before the string, or after it when it is included)."""

    stop: str
    text_end: int


def find_stop_string(
    text: str, num_new_chars: int, stop_strings: list[str], include_in_output: bool
) -> StopStringMatch | None:
    """The earliest stop string that ends inside the last `num_new_chars` characters of
    `text` (one split across tokens included); None if none matched."""
    best: tuple[int, str] | None = None
    for stop in stop_strings:
        # A match must end inside the new text, so it starts at most len(stop) - 1 before it.
        start = max(len(text) - num_new_chars - len(stop) + 1, 0)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    index, stop = best
    return StopStringMatch(stop, index + len(stop) if include_in_output else index)
