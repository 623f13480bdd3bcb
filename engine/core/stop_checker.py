"""Stop rules as decisions: token rules for the core, stop strings for the front end."""

from __future__ import annotations

from dataclasses import dataclass

from octavo.engine.core.sequence import Sequence
from octavo.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopDecision:
    """Why a sample ends: finish_reason "stop" (stop_reason: the stop token id or stop
    string) or "length". `text_end`, for a stop string, is where its text is cut."""

    finish_reason: str
    stop_reason: int | str | None = None
    text_end: int | None = None


_STOP_ON_EOS = StopDecision("stop")
_STOP_ON_LENGTH = StopDecision("length")


class StopChecker:
    """vLLM's token stop rules, in order, for a sequence that just received a token.

    Before `min_tokens` outputs only the length limits apply (the sampler already keeps EOS and
    stop_token_ids from being drawn). Then: EOS (unless ignore_eos), stop_token_ids,
    max_tokens, max_model_len. Stop strings are text, matched by the front end
    (`find_stop_string`), which takes precedence over a length limit reached on the same token.
    """

    def __init__(self, max_model_len: int, eos_token_id: int | None):
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id

    def screen(self, params: SamplingParams, num_prompt_tokens: int) -> tuple[frozenset[int], int]:
        """A request's cheap pre-test: `check` can only stop a sequence whose new token is in
        the returned set (EOS unless ignored, stop_token_ids) or whose length reaches the
        returned count (max_tokens or max_model_len, whichever comes first)."""
        tokens = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            tokens.add(self.eos_token_id)
        return frozenset(tokens), min(num_prompt_tokens + params.max_tokens, self.max_model_len)

    def check(self, seq: Sequence, params: SamplingParams) -> StopDecision | None:
        # Runs for every sampled token: locals instead of properties, shared decisions.
        token_ids = seq.token_ids
        num_tokens = len(token_ids)
        num_output = num_tokens - len(seq.prompt_token_ids)
        token_id = token_ids[-1]
        if num_output >= params.min_tokens:
            if token_id == self.eos_token_id and not params.ignore_eos:
                return _STOP_ON_EOS
            if params.stop_token_ids and token_id in params.stop_token_ids:
                return StopDecision("stop", stop_reason=token_id)
        if num_output >= params.max_tokens or num_tokens >= self.max_model_len:
            return _STOP_ON_LENGTH
        return None


def find_stop_string(
    text: str, num_new_chars: int, stop_strings: list[str], include_in_output: bool
) -> StopDecision | None:
    """The earliest stop string that ends inside the last `num_new_chars` characters of
    `text` (one split across tokens included), as a decision whose `text_end` cuts the text
    before the string, or after it with `include_in_output`; None if none matched."""
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
    end = index + len(stop) if include_in_output else index
    return StopDecision("stop", stop_reason=stop, text_end=end)
