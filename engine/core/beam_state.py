"""A beam group's search state and HF's score arithmetic: data only, no block bookkeeping."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from octavo.engine.core_messages import BeamResult
from octavo.engine.sampling_params import BeamSearchParams

# Hugging Face marks impossible candidates and empty hypothesis slots with this score; using
# the same float32 arithmetic keeps every ranking, ties included, identical to theirs.
NEG_INF_SCORE = -1.0e9


def length_normalizer(length: int, length_penalty: float) -> float:
    """`length ** length_penalty` as HF computes it, but an overflow gives inf (the score
    then rounds to 0) instead of raising: any finite length_penalty is a valid request."""
    try:
        return math.pow(length, length_penalty)
    except OverflowError:
        return math.inf


def normalized_score(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    """cumulative_logprob / length ** length_penalty in Python floats, with the IEEE results
    (an infinity, or NaN for 0 / 0) where the denominator underflows to 0."""
    denominator = length_normalizer(length, length_penalty)
    if denominator == 0.0:
        return math.copysign(math.inf, cumulative_logprob) if cumulative_logprob else math.nan
    return cumulative_logprob / denominator


@dataclass
class BeamState:
    """A beam group's search state; the live beams are the group's unfinished sequences, in
    the order of `running_scores` (best first)."""

    params: BeamSearchParams
    stop_token_ids: list[int]
    max_new_tokens: int
    running_scores: torch.Tensor  # float32 [num_live_beams]
    # beam_width slots, best first (None: empty), for the hypotheses: finished beams, as they
    # are returned (generated tokens ending in the stop token if it stopped; score:
    # cumulative_logprob / len(token_ids) ** length_penalty).
    slots: list[BeamResult | None] = field(default_factory=list)
    # float32 [beam_width], NEG_INF_SCORE if empty (create() sizes it).
    slot_scores: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    heuristic_unsatisfied: bool = True
    # The live beams after the last step: (seq_id, parent seq_id, token) each.
    last_choices: list[tuple[int, int, int]] = field(default_factory=list)

    @classmethod
    def create(
        cls, params: BeamSearchParams, stop_token_ids: list[int], max_new_tokens: int
    ) -> BeamState:
        """`stop_token_ids`: the request's stop tokens (`stop_rules.stop_token_set`)."""
        width = params.beam_width
        return cls(
            params,
            list(stop_token_ids),
            max_new_tokens,
            torch.zeros(1),
            slots=[None] * width,
            slot_scores=torch.full((width,), NEG_INF_SCORE),
        )

    @property
    def candidates_per_step(self) -> int:
        """HF keeps (1 + number of stop tokens) x beam_width candidates, at least 2 x."""
        return max(2, 1 + len(self.stop_token_ids)) * self.params.beam_width

    @property
    def candidates_needed(self) -> int:
        """Next tokens needed per beam: the candidates of a step plus the stop tokens that
        min_tokens may mask out of them (see BeamCandidates)."""
        return self.candidates_per_step + len(self.stop_token_ids)

    def hypotheses(self) -> list[BeamResult]:
        return [h for h in self.slots if h is not None]
