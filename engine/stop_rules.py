"""The token stop rules' two quantities, each defined once: which tokens end a sample, and at
what length. The front end computes the stop tokens when it processes a request; the core
applies both (`StopChecker`), the sampler keeps the stop tokens from being drawn before
min_tokens, and beam search ranks them as hypotheses."""

from __future__ import annotations


def stop_token_set(
    stop_token_ids: list[int], ignore_eos: bool, eos_token_ids: list[int]
) -> list[int]:
    """The tokens that end a sample: the model's EOS tokens first (unless ignored), then the
    request's stop_token_ids, each once, in that order."""
    stops = [] if ignore_eos else list(eos_token_ids)
    stops += [t for t in dict.fromkeys(stop_token_ids) if t not in stops]
    return stops


def length_limit(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """The number of tokens (prompt included) at which a sequence ends for length: after
    max_tokens outputs, or at max_model_len, whichever comes first."""
    return min(num_prompt_tokens + max_tokens, max_model_len)
