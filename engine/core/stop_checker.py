"""The token stop rules as decisions, applied by the core to every sampled token."""

from __future__ import annotations

from octavo.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus


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
    ) -> SequenceStatus | None:
        """The status a rule finishes `seq` with: FINISHED_STOPPED (finish_reason "stop";
        a matched stop_token_ids entry is recorded as `seq.stop_reason`) or FINISHED_LENGTH,
        None while no rule applies."""
        # Runs for every token that may stop: locals instead of properties.
        token_ids = seq.token_ids
        num_tokens = len(token_ids)
        token_id = token_ids[-1]
        params = group.sampling
        if (
            token_id in group.stop_token_ids
            and num_tokens - len(seq.prompt_token_ids) >= params.min_tokens
        ):
            if token_id not in self.eos_token_ids or params.ignore_eos:
                seq.stop_reason = token_id
            return SequenceStatus.FINISHED_STOPPED
        if grammar_ended:
            return SequenceStatus.FINISHED_STOPPED
        if num_tokens >= group.max_num_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None
