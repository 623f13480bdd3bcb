"""What the engine returns for a request (vLLM's RequestOutput / CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One generated sequence of a request, whole or (RequestOutputKind.DELTA) what it gained
    since the previous output.

    token_ids includes the EOS or stop token that ended it (text does not). logprobs holds,
    per generated token, {token_id: logprob} for the sampled token and the top-N alternatives
    when SamplingParams.logprobs was set, else None. finish_reason is "stop", "length",
    "abort", "error" or None while running; stop_reason is the stop string or token id that
    matched.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless logprobs were asked for (as vLLM)
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float | None = None  # beam search: cumulative_logprob / length ** length_penalty

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, later: CompletionOutput) -> None:
        """Appends a later delta of the same sample to this one (in place: a delta's lists
        are its own)."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs.extend(later.logprobs)
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.score = later.score


@dataclass(frozen=True)
class RequestMetrics:
    """time.monotonic() stamps of a request's life; None for what has not happened yet."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


@dataclass
class RequestOutput:
    """A request's outputs, best or first sample first; `finished` once all are done.

    With RequestOutputKind.DELTA, `outputs` holds only the samples that progressed, each with
    what it gained; the deltas of a request concatenate to its final output.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request failed (finish_reason "error")
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, then
    # {token_id: logprob} with the prompt token first and the best tokens at its position.
    # With RequestOutputKind.DELTA only the first output carries them. The prompt tokens'
    # ranks among the vocabulary at their positions (1: the most likely; None first).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None
    # Prompt tokens whose K/V came from the prefix cache (None until the request is admitted).
    num_cached_tokens: int | None = None

    def add(self, later: RequestOutput) -> None:
        """Merges a later delta output of the same request into this one (a client reading
        slower than tokens arrive gets one event for several steps)."""
        by_index = {c.index: c for c in self.outputs}
        for completion in later.outputs:
            if completion.index in by_index:
                by_index[completion.index].add(completion)
            else:
                self.outputs.append(completion)
                by_index[completion.index] = completion
        self.outputs.sort(key=lambda c: c.index)
        self.finished = later.finished
        self.metrics = later.metrics
        self.error = later.error
        if later.num_cached_tokens is not None:
            self.num_cached_tokens = later.num_cached_tokens
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
            self.prompt_token_ranks = later.prompt_token_ranks
