"""Speculative decoding's settings (vLLM's `speculative_config`) and its n-gram proposer
(the draft-model proposer is the worker's: engine/worker/draft_model.py).

Prompt lookup ("ngram"): the draft of a sequence is what followed the latest earlier
occurrence of its last few tokens in its own prompt and output. Quoting, summarizing and
editing repeat their input, and a draft of k tokens costs about one decode step to verify
where a step is bound by reading the weights (a CPU at batch 1) or by launches (a GPU at a
small batch): the target model computes the k + 1 positions at once and every draft token
it agrees with is a step saved.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from octavo.engine.sampling_params import BeamSearchParams, SamplingParams, is_int

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# vLLM's prompt lookup window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """`num_speculative_tokens` draft tokens a step, for no running batch larger than
    `disable_by_batch_size` (None: any), where speculation only adds work. Method "ngram":
    prompt lookup over windows of `prompt_lookup_min` to `prompt_lookup_max` tokens (one
    bound given: both; none: 5). Method "draft_model" (implied by `model`): the greedy
    tokens of the model at `model`, which must share the target's vocabulary (checked when
    the engine loads it)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int | None = None
    model: str | None = None

    @classmethod
    def parse(cls, value: str | Mapping[str, Any]) -> SpeculativeConfig:
        """From vLLM's JSON (or its dict); a ValueError names the field that is wrong."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not JSON ({exc})") from None
        if not isinstance(value, Mapping):
            raise ValueError("speculative_config: a JSON object is expected")
        known = {field.name for field in dataclasses.fields(cls)}
        for key in value:
            if key not in known:
                raise ValueError(f"speculative_config: unknown field {key!r}")
        model = value.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(
                f"speculative_config.model must be a model name or path, got {model!r}"
            )
        method = value.get("method", "draft_model" if model is not None else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
        if (method == "draft_model") != (model is not None):
            raise ValueError(
                "speculative_config.model: method 'draft_model' needs a model, and a model "
                f"needs method 'draft_model', got method {method!r} and model {model!r}"
            )
        k = _integer(value, "num_speculative_tokens", required=True)
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k}"
            )
        low = _integer(value, "prompt_lookup_min")
        high = _integer(value, "prompt_lookup_max")
        if method != "ngram" and (low is not None or high is not None):
            raise ValueError(
                "speculative_config: prompt_lookup_min and prompt_lookup_max apply to method "
                f"'ngram', not {method!r}"
            )
        low = low if low is not None else high if high is not None else DEFAULT_PROMPT_LOOKUP
        high = high if high is not None else low
        if not 1 <= low <= high:
            raise ValueError(
                "speculative_config: prompt_lookup_min must be >= 1 and <= prompt_lookup_max, "
                f"got {low} and {high}"
            )
        limit = _integer(value, "disable_by_batch_size")
        if limit is not None and limit < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size must be >= 1, got {limit}")
        return cls(method, k, low, high, limit, model)


def can_speculate(params: SamplingParams | BeamSearchParams) -> bool:
    """Whether a request's tokens keep their distribution with speculation: samples whose
    logits at a draft position depend on nothing but the tokens before it (no penalties,
    min_tokens, bad words or grammar, which follow the output so far, row by row). The
    others run unspeculated; beam search always does.

    Each verified position is sampled as usual, and the run is kept up to the first sampled
    token that is not the draft's, that one included. For a draft of fixed tokens (prompt
    lookup) this is rejection sampling exactly: a draft token d is kept with probability
    p(d) = min(1, p(d) / q(d)) where q(d) = 1, and the token kept instead is drawn from p
    with d removed, the normalized residual max(0, p - q). Greedy output is unchanged."""
    return (
        isinstance(params, SamplingParams)
        and not params.has_penalties
        and params.min_tokens == 0
        and not params.bad_words
        and params.structured_outputs is None
    )


def _integer(fields: Mapping[str, Any], key: str, required: bool = False) -> Any:
    value = fields.get(key)
    if value is None and not required:
        return None
    if not is_int(value):
        raise ValueError(f"speculative_config.{key} must be an integer, got {value!r}")
    return value


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens: those that followed the latest earlier occurrence of the longest
    suffix of `tokens` of `min_n` to `max_n` tokens (none when no such suffix recurs)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        last = pattern[-1]
        # Candidate ends, latest first: positions before the suffix's own end.
        for end in range(length - 2, n - 2, -1):
            if tokens[end] == last and tokens[end - n + 1 : end + 1] == pattern:
                return tokens[end + 1 : end + 1 + k]
    return []
