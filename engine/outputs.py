"""What the engine returns for a request (vLLM's RequestOutput / CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass

from octavo.engine.beam_search import Hypothesis, normalized_score
from octavo.engine.sampling_params import BeamSearchParams, SamplingParams
from octavo.engine.sequence import Sequence, SequenceGroup
from octavo.engine.tokenizer import Tokenizer


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    token_ids includes the EOS or stop token that ended it (text does not). logprobs holds,
    per generated token, {token_id: logprob} for the sampled token and the top-N alternatives
    when SamplingParams.logprobs was set, else None. finish_reason is "stop", "length",
    "abort" or None while running; stop_reason is the stop string or token id that matched.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float | None = None  # beam search: cumulative_logprob / length ** length_penalty

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """time.monotonic() stamps of a request's life; None for what has not happened yet."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


@dataclass
class RequestOutput:
    """A request's outputs, best or first sample first; `finished` once all are done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request failed (finish_reason "error")

    @classmethod
    def from_group(cls, group: SequenceGroup, tokenizer: Tokenizer | None) -> RequestOutput:
        if group.beam is not None:
            outputs = _beam_completions(group, tokenizer)
        else:
            params = group.sampling_params
            assert isinstance(params, SamplingParams)
            want_logprobs = params.logprobs is not None
            outputs = [_completion(i, seq, want_logprobs) for i, seq in enumerate(group.seqs)]
            if group.is_finished:  # ended before its prompt forked into n samples
                outputs += [
                    _unstarted(i, group.seqs[0], want_logprobs)
                    for i in range(len(outputs), params.n)
                ]
        metrics = RequestMetrics(
            group.arrival_time,
            group.first_scheduled_time,
            group.first_token_time,
            group.finished_time,
        )
        return cls(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            outputs,
            group.is_finished,
            metrics,
            group.error,
        )

    @classmethod
    def failed(cls, group: SequenceGroup) -> RequestOutput:
        """The final output of a failed request when even building its outputs failed."""
        return cls(
            group.request_id, group.prompt, group.prompt_token_ids, [], True, None, group.error
        )


def _beam_completions(group: SequenceGroup, tokenizer: Tokenizer | None) -> list[CompletionOutput]:
    """The best num_return_sequences hypotheses, best first. A search aborted before any
    hypothesis finished reports its live beams, best first, with finish_reason "abort" (or
    "error" for a search that failed)."""
    params, beam = group.sampling_params, group.beam
    assert isinstance(params, BeamSearchParams) and beam is not None
    hypotheses = beam.hypotheses()
    if not hypotheses:
        reason = "abort" if group.error is None else "error"
        hypotheses = [
            Hypothesis(
                seq.output_token_ids,
                cumulative,
                normalized_score(cumulative, max(seq.num_output_tokens, 1), params.length_penalty),
                reason,
            )
            for seq, cumulative in zip(group.seqs, beam.running_scores.tolist(), strict=False)
        ]
    return [
        CompletionOutput(
            index=i,
            text=tokenizer.decode(h.token_ids, params.skip_special_tokens) if tokenizer else "",
            token_ids=h.token_ids,
            cumulative_logprob=h.cumulative_logprob,
            logprobs=None,
            finish_reason=h.finish_reason,
            score=h.score,
        )
        for i, h in enumerate(hypotheses[: params.num_return_sequences])
    ]


def _completion(index: int, seq: Sequence, want_logprobs: bool) -> CompletionOutput:
    return CompletionOutput(
        index=index,
        text=seq.detokenizer.text,
        token_ids=seq.output_token_ids,
        cumulative_logprob=seq.cumulative_logprob,
        logprobs=list(seq.output_logprobs) if want_logprobs else None,
        finish_reason=seq.status.finish_reason,
        stop_reason=seq.stop_reason,
    )


def _unstarted(index: int, first: Sequence, want_logprobs: bool) -> CompletionOutput:
    """Sample `index` of a request that finished (aborted, failed) before it was forked:
    nothing generated, the first sequence's finish reason."""
    return CompletionOutput(
        index=index,
        text="",
        token_ids=[],
        cumulative_logprob=0.0,
        logprobs=[] if want_logprobs else None,
        finish_reason=first.status.finish_reason,
    )
