"""The token stop rules as decisions, applied by the core to every sampled token."""

from __future__ import annotations

from dataclasses import dataclass

from octavo.engine.core.sequence import Sequence, SequenceGroup


@dataclass(frozen=True)
class StopDecision:
    """Why a sample ends: finish_reason "stop" (stop_reason: the stop token id, None for
    EOS or a complete grammar) or "length"."""

    finish_reason: str
    stop_reason: int | None = None


_STOP_ON_EOS = StopDecision("stop")  # also: a structured output's grammar is complete
_STOP_ON_LENGTH = StopDecision("length")


class StopChecker:
    """vLLM's token stop rules, in order, for a sequence that just received a token.

    Before `min_tokens` outputs only the length limit applies (the sampler already keeps the
    stop tokens from being drawn). Then: a stop token (an EOS, unless ignore_eos, with no
    stop_reason; a stop_token_ids entry as its own stop_reason), then a structured output's
    complete grammar (`grammar_ended`: the output is whole, so "stop" wins over a length limit
    reached on the same token), then the length limit (`group.max_num_tokens`: max_tokens or
    max_model_len). Stop strings are text, matched by the front end, which takes precedence
    over a length limit reached on the same token.
    """

    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = frozenset(eos_token_ids)

    def check(
        self, seq: Sequence, group: SequenceGroup, grammar_ended: bool = False
    ) -> StopDecision | None:
        # Runs for every token that may stop: locals instead of properties, shared decisions.
        token_ids = seq.token_ids
        num_tokens = len(token_ids)
        token_id = token_ids[-1]
        params = group.sampling
        if (
            token_id in group.stop_token_ids
            and num_tokens - len(seq.prompt_token_ids) >= params.min_tokens
        ):
            if token_id in self.eos_token_ids and not params.ignore_eos:
                return _STOP_ON_EOS
            return StopDecision("stop", stop_reason=token_id)
        if grammar_ended:
            return _STOP_ON_EOS
        if num_tokens >= group.max_num_tokens:
            return _STOP_ON_LENGTH
        return None
