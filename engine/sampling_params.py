"""Per-request sampling parameters (vLLM's names and defaults), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import ClassVar, TypeGuard

from octavo.engine.errors import ParameterError
from octavo.engine.structured_outputs import StructuredOutputsParams

# The integer parameters the sampler keeps in int64 columns (seed, as in vLLM, and top_k)
# must fit one: a larger top_k would fail the step of every request in its batch.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A temperature below this samples greedily, as in vLLM: a draw at such a temperature is the
# argmax anyway, and dividing logits by a smaller one overflows float32.
MIN_SAMPLING_TEMPERATURE = 1e-5


def is_int(value: object) -> TypeGuard[int]:
    """An integer that is not a bool (True is not a token count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _as_list(name: str, value: object) -> list:
    """None as [], a list or tuple as a list; anything else names the parameter."""
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise ParameterError(name, f"{name} must be a list, got {value!r}")
    return list(value)


def _check_int(name: str, value: object, minimum: int) -> None:
    """An integer (not a bool) of at least `minimum`."""
    if not is_int(value) or value < minimum:
        raise ParameterError(name, f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_int64(name: str, value: object) -> None:
    """An integer (not a bool) that fits the sampler's int64 columns."""
    if not is_int(value) or not INT64_MIN <= value <= INT64_MAX:
        raise ParameterError(
            name, f"{name} must be an integer in [-2**63, 2**63 - 1], got {value!r}"
        )


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ParameterError(name, f"{name} must be True or False, got {value!r}")


def _check_finite(name: str, value: object) -> None:
    """Numbers only (no bools), and neither NaN nor an infinity."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ParameterError(name, f"{name} must be a finite number, got {value!r}")


class RequestOutputKind(Enum):
    """Which outputs a request produces while it runs."""

    CUMULATIVE = "cumulative"  # every step: everything generated so far
    DELTA = "delta"  # every step: only what the step added
    FINAL_ONLY = "final_only"  # once, when the request finishes


@dataclass(kw_only=True)
class GenerationParams:
    """What sampling and beam search share: the length bounds (max_tokens generated at most,
    min_tokens before a stop token may end a sample), the stop tokens (`stop_token_ids`
    beside EOS, which `ignore_eos` drops), whether the text skips special tokens, and a
    `structured_outputs` constraint, which decides where the output ends (EOS is allowed
    exactly where its grammar accepts) and so takes neither ignore_eos nor min_tokens.
    Keyword-only, after each kind's own fields."""

    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    # None is taken for [] (vLLM accepts it); stored as a list.
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ParameterError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            )
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ParameterError(
                "stop_token_ids",
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}",
            )
        constraint = self.structured_outputs
        if constraint is None:
            return
        if not isinstance(constraint, StructuredOutputsParams):
            raise ParameterError(
                "structured_outputs",
                f"structured_outputs must be a StructuredOutputsParams, got {constraint!r}",
            )
        for name in ("ignore_eos", "min_tokens"):
            if getattr(self, name):
                raise ParameterError(name, f"{name} cannot be combined with structured outputs")


@dataclass
class SamplingParams(GenerationParams):
    """How to pick the next tokens of one request.

    temperature 0 (or below MIN_SAMPLING_TEMPERATURE) is greedy. top_k <= 0 and top_p == 1
    and min_p == 0 disable those filters.
    Penalties follow vLLM: repetition_penalty (>1 discourages) acts on prompt and output tokens,
    presence/frequency penalties on output tokens only. `seed` gives the request its own random
    generator, so its tokens do not depend on what else is batched with it. `logprobs=N` returns
    the N most likely tokens' log-probabilities (plus the sampled one) at each step;
    `prompt_logprobs=N` the same for every prompt token after the first (the prompt token's
    own log-probability given the tokens before it, plus the N most likely tokens there).
    Token controls, as vLLM: `logit_bias` adds to the logits of token ids, `allowed_token_ids`
    keeps only those tokens, `bad_words` bans every word's last token after its other tokens
    (a one-token word always), `truncate_prompt_tokens` keeps the prompt's last N tokens.
    `structured_outputs` constrains the text to a JSON schema, regex, choice or grammar: its
    mask applies after the other logits processing and before temperature, top-k and top-p
    (vLLM's order), and a sample ends with "stop" once its grammar is complete (EOS is
    allowed exactly where the grammar accepts, so it takes neither ignore_eos nor
    min_tokens). Every invalid value raises ValueError naming the parameter.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.stop_strings = (
            [self.stop] if isinstance(self.stop, str) else _as_list("stop", self.stop)
        )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = _as_list("bad_words", self.bad_words)
        _check_int("n", self.n, 1)
        if self.best_of is not None and (not is_int(self.best_of) or self.best_of < self.n):
            raise ParameterError(
                "best_of", f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}"
            )
        for name in (
            "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
            "top_p", "min_p",
        ):  # fmt: skip
            _check_finite(name, getattr(self, name))
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.seed is not None:
            _check_int64("seed", self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ParameterError(name, f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0.0:
            raise ParameterError(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            )
        if self.temperature < 0.0:
            raise ParameterError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check_int64("top_k", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise ParameterError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0)
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ParameterError("stop", f"stop must hold non-empty strings, got {self.stop!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ParameterError(
                    "logit_bias",
                    f"logit_bias must map token ids to biases, got {self.logit_bias!r}",
                )
            for token, bias in self.logit_bias.items():
                if not is_int(token) or token < 0:
                    raise ParameterError(
                        "logit_bias", f"logit_bias keys must be token ids >= 0, got {token!r}"
                    )
                _check_finite("logit_bias", bias)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ParameterError("allowed_token_ids", "allowed_token_ids must not be empty")
            if any(not is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise ParameterError(
                    "allowed_token_ids",
                    f"allowed_token_ids must be token ids >= 0, got {self.allowed_token_ids}",
                )
        if self.bad_words is not None and any(
            not isinstance(w, str) or not w.strip() for w in self.bad_words
        ):
            raise ParameterError(
                "bad_words", f"bad_words must hold words, not blanks: {self.bad_words!r}"
            )
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs: best_of of them when set, of which the n with the
        highest cumulative log-probability are returned; else n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def ranks_samples(self) -> bool:
        """best_of > n: the samples are ranked (by cumulative logprob) at the end."""
        return self.best_of is not None and self.best_of > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @cached_property
    def is_plain_greedy(self) -> bool:
        """Greedy, with no log-probabilities and nothing that changes the logits: the
        sampler's fast path. Cached: the sampler asks for every row of every step."""
        return (
            self.greedy
            and self.logprobs is None
            and not self.ranks_samples
            and not self.processes_logits
            and not self.has_penalties
            and self.structured_outputs is None
        )

    @cached_property
    def processes_logits(self) -> bool:
        """Something changes this request's logits row by row before a token is picked:
        min_tokens, logit_bias, allowed_token_ids or bad_words (penalties and a
        structured-output grammar's mask are applied to all their rows at once, apart)."""
        return bool(
            self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words
        )

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass
class BeamSearchParams(GenerationParams):
    """Beam search with Hugging Face `generate(num_beams=...)` semantics.

    beam_width beams are kept; each step the 2 x beam_width (more with several stop tokens)
    best continuations are ranked, those ending in EOS or a stop token among the first
    beam_width become finished hypotheses scored `sum(logprobs) / length ** length_penalty`,
    and the best others continue. early_stopping: True stops once beam_width hypotheses are
    finished; False stops when no running beam can beat the worst finished one at its current
    length; "never" assumes the longest possible length when length_penalty > 0. A beam_width
    of 1 is greedy decoding, as in HF. The num_return_sequences best hypotheses are returned.
    A structured_outputs constraint holds for every beam (its grammar state forks with it).
    """

    beam_width: int
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # Sampling's options that a beam search never has, as sampling's defaults: callers
    # read them of either kind of params.
    stop_strings: ClassVar[tuple[str, ...]] = ()
    logprobs: ClassVar[None] = None
    prompt_logprobs: ClassVar[None] = None
    bad_words: ClassVar[None] = None
    truncate_prompt_tokens: ClassVar[None] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int("beam_width", self.beam_width, 1)
        _check_finite("length_penalty", self.length_penalty)
        if not is_int(self.num_return_sequences) or not (
            1 <= self.num_return_sequences <= self.beam_width
        ):
            raise ParameterError(
                "num_return_sequences",
                f"num_return_sequences must be in [1, beam_width={self.beam_width}], got "
                f"{self.num_return_sequences}",
            )
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ParameterError(
                "early_stopping",
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}",
            )

    @property
    def n(self) -> int:
        """Sequences the request keeps in the batch at once."""
        return self.beam_width

    @property
    def num_sequences(self) -> int:
        return self.beam_width
