"""Turns the core's delta outputs into RequestOutputs: detokenization, stop strings, holdback.

The front end's half of every request (vLLM's OutputProcessor). The core sends token ids only;
here they become text, one incremental detokenizer per sample (a request that wants only its
final output and has no stop strings is detokenized once, when it ends: no text of it is
read before then). Stop strings are matched here:
a match finishes the sample at once (a token the core computed past it is discarded) and asks
the core to stop it (`SampleAbort`). While a sample runs, the last `max(len(stop)) - 1`
characters of its text are held back, since a later token may complete a stop string that
must never reach the client.

A stream (DELTA) may ask for fewer, larger outputs: with `stream_interval` N a sample's first
token comes out at once, then once N more tokens have gathered, and its finish flushes what
is left (vLLM's --stream-interval). The deltas concatenate to the same output either way.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from octavo.engine.core_messages import (
    BeamResult,
    EngineCoreOutput,
    SampleAbort,
    SampleDelta,
)
from octavo.engine.frontend.outputs import CompletionOutput, RequestMetrics, RequestOutput
from octavo.engine.frontend.stop_strings import find_stop_string
from octavo.engine.frontend.tokenizer import IncrementalDetokenizer, Tokenizer
from octavo.engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _SampleState:
    """One sample's text so far and what of it was already emitted (DELTA)."""

    index: int
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_end: int | None = None  # where a matched stop string cut the text
    sent_tokens: int = 0
    sent_chars: int = 0

    @property
    def text(self) -> str:
        return self.detokenizer.text[: self.text_end]

    def visible_end(self, holdback: int) -> int:
        """How much of the text may be shown: all once finished, else all but the holdback."""
        if self.finish_reason is not None:
            return len(self.text)
        return max(len(self.text) - holdback, self.sent_chars)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    arrival_time: float
    holdback: int
    output_kind: RequestOutputKind
    # FINAL_ONLY without stop strings: nothing reads the text before the end, so the
    # detokenizer catches up once then instead of stepping every token.
    text_at_end: bool
    samples: dict[int, _SampleState] = field(default_factory=dict)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Asked for: [None] (the first prompt token has none), then each chunk the core sends.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None
    prompt_logprobs_sent: bool = False  # DELTA: the first output carried them
    num_cached_tokens: int | None = None

    @property
    def all_samples_finished(self) -> bool:
        return len(self.samples) == self.params.num_sequences and all(
            s.finish_reason is not None for s in self.samples.values()
        )


@dataclass
class ProcessedOutputs:
    """What one batch of core outputs gave: RequestOutputs to deliver, and what the core must
    stop (samples that hit a stop string; requests whose outputs could not be built)."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    sample_aborts: list[SampleAbort] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


class OutputProcessor:
    """Holds the front-end state of every unfinished request; not thread-safe (one owner:
    the offline engine, or the AsyncEngine's event loop)."""

    def __init__(self, tokenizer: Tokenizer | None, stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._requests: dict[str, _RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | BeamSearchParams,
        arrival_time: float,
    ) -> None:
        stops = params.stop_strings if isinstance(params, SamplingParams) else []
        holdback = max((len(s) for s in stops), default=1) - 1
        if isinstance(params, BeamSearchParams) or params.ranks_samples:
            kind = RequestOutputKind.FINAL_ONLY  # ranked whole: only the end counts
        else:
            kind = params.output_kind
        text_at_end = kind is RequestOutputKind.FINAL_ONLY and not stops
        state = _RequestState(
            request_id, prompt, prompt_token_ids, params, arrival_time, holdback, kind, text_at_end
        )
        if isinstance(params, SamplingParams) and params.prompt_logprobs is not None:
            state.prompt_logprobs, state.prompt_token_ranks = [None], [None]
        self._requests[request_id] = state

    def forget(self, request_id: str) -> None:
        """Drops a request whose outputs nobody will read (its core request is gone too)."""
        self._requests.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Applies one step's core outputs. Outputs of unknown (finished, forgotten) requests
        are ignored; a request whose output cannot be built fails alone."""
        result = ProcessedOutputs()
        for output in outputs:
            state = self._requests.get(output.request_id)
            if state is None:
                continue
            try:
                request_output = self._process_one(state, output, result.sample_aborts)
            except Exception as exc:  # noqa: BLE001 -- one request's fault is its own
                logger.error("request %s failed", state.request_id, exc_info=exc)
                del self._requests[state.request_id]
                if not output.finished:
                    result.aborts.append(state.request_id)
                request_output = self._failed(state, f"{type(exc).__name__}: {exc}")
            if request_output is not None:
                result.request_outputs.append(request_output)
        return result

    # -- one request -------------------------------------------------------------------------

    def _process_one(
        self, state: _RequestState, output: EngineCoreOutput, sample_aborts: list[SampleAbort]
    ) -> RequestOutput | None:
        now = time.monotonic()
        if output.first_scheduled_time is not None:
            state.first_scheduled_time = output.first_scheduled_time
        if output.first_token_time is not None and state.first_token_time is None:
            state.first_token_time = output.first_token_time
        if output.num_cached_tokens is not None:
            state.num_cached_tokens = output.num_cached_tokens
        chunk = output.prompt_logprobs
        if chunk is not None and state.prompt_logprobs is not None:
            assert state.prompt_token_ranks is not None
            state.prompt_logprobs += chunk.logprobs
            state.prompt_token_ranks += chunk.ranks
        progressed: list[_SampleState] = []
        any_sample_finished = False
        for delta in output.samples:
            sample = self._sample(state, delta.index)
            if sample.finish_reason is not None:
                continue  # finished here (a stop string) before the core heard of it
            if delta.new_token_ids and state.first_token_time is None:
                state.first_token_time = now
            if state.text_at_end:
                self._append(state, sample, delta)
            else:
                self._apply(state, sample, delta)
            if sample.finish_reason is not None:
                any_sample_finished = True
                if delta.finish_reason is None:
                    sample_aborts.append(SampleAbort(state.request_id, sample.index))
            progressed.append(sample)
        finished = output.finished or (any_sample_finished and state.all_samples_finished)
        if finished:
            del self._requests[state.request_id]
            if output.beams is not None:
                return self._beam_output(state, output.beams, output.error, now)
            progressed += self._end_unfinished(state, output.error)
        kind = state.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind is RequestOutputKind.DELTA:
            progressed = [s for s in progressed if self._due(s)]
        if not progressed and not finished:
            return None
        if kind is RequestOutputKind.DELTA:
            completions = [self._delta(state, s) for s in sorted(progressed, key=_by_index)]
        else:
            completions = [
                self._whole(state, s) for s in sorted(state.samples.values(), key=_by_index)
            ]
            if isinstance(state.params, SamplingParams) and state.params.ranks_samples:
                completions = _best(completions, state.params.n)
        metrics = self._metrics(state, now) if finished else None
        prompt_logprobs, ranks = state.prompt_logprobs, state.prompt_token_ranks
        if kind is RequestOutputKind.DELTA:
            if state.prompt_logprobs_sent:
                prompt_logprobs = ranks = None
            state.prompt_logprobs_sent = True
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            completions,
            finished,
            metrics,
            output.error if finished else None,
            prompt_logprobs,
            ranks,
            state.num_cached_tokens,
        )

    def _sample(self, state: _RequestState, index: int) -> _SampleState:
        sample = state.samples.get(index)
        if sample is None:
            params = state.params
            skip = params.skip_special_tokens
            want_logprobs = isinstance(params, SamplingParams) and params.logprobs is not None
            sample = _SampleState(
                index, IncrementalDetokenizer(self.tokenizer, skip), want_logprobs
            )
            state.samples[index] = sample
        return sample

    @staticmethod
    def _append(state: _RequestState, sample: _SampleState, delta: SampleDelta) -> None:
        """`_apply` for text_at_end: appends a delta's tokens undecoded; the core's finish
        applies, and the whole text is decoded then, as `_apply` would have built it."""
        sample.cumulative_logprob = delta.cumulative_logprob
        sample.token_ids += delta.new_token_ids
        if sample.want_logprobs and delta.new_logprobs is not None:
            sample.logprobs += delta.new_logprobs
        if delta.finish_reason is not None:
            assert isinstance(state.params, SamplingParams)  # beams never reach samples
            sample.finish_reason = delta.finish_reason
            sample.stop_reason = delta.stop_reason
            sample.detokenizer.flush(_without_stop_token(sample, state.params))

    def _apply(self, state: _RequestState, sample: _SampleState, delta: SampleDelta) -> None:
        """Appends a delta's tokens, matching stop strings token by token; the core's own
        finish (a token rule) applies unless a stop string ended the sample first."""
        params = state.params
        assert isinstance(params, SamplingParams)
        sample.cumulative_logprob = delta.cumulative_logprob
        num_tokens = len(delta.new_token_ids)
        for i, token_id in enumerate(delta.new_token_ids):
            sample.token_ids.append(token_id)
            if sample.want_logprobs and delta.new_logprobs is not None:
                sample.logprobs.append(delta.new_logprobs[i])
            last = i == num_tokens - 1
            stop_token = last and isinstance(delta.stop_reason, int)
            if stop_token and not params.include_stop_str_in_output:
                break  # a stop token's own text is not part of the output
            new_text = sample.detokenizer.step(sample.token_ids)
            if (
                params.stop_strings
                and new_text
                and len(sample.token_ids) >= params.min_tokens
                and not stop_token
            ):
                match = find_stop_string(
                    sample.detokenizer.text,
                    len(new_text),
                    params.stop_strings,
                    params.include_stop_str_in_output,
                )
                if match is not None:
                    sample.text_end = match.text_end
                    sample.finish_reason = "stop"
                    sample.stop_reason = match.stop
                    return
        if delta.finish_reason is not None:
            sample.finish_reason = delta.finish_reason
            sample.stop_reason = delta.stop_reason
            sample.detokenizer.flush(_without_stop_token(sample, params))

    def _due(self, sample: _SampleState) -> bool:
        """Whether a stream's sample that progressed is sent now: its first tokens, its
        finish, or `stream_interval` tokens since it was last sent."""
        return (
            sample.finish_reason is not None
            or sample.sent_tokens == 0
            or len(sample.token_ids) - sample.sent_tokens >= self.stream_interval
        )

    def _end_unfinished(self, state: _RequestState, error: str | None) -> list[_SampleState]:
        """Gives every sample still open at the request's end (never started: a request
        aborted before its prompt forked into n samples) the request's end."""
        ended = []
        reason = "error" if error is not None else "abort"
        for index in range(state.params.num_sequences):
            sample = self._sample(state, index)
            if sample.finish_reason is None:
                sample.finish_reason = reason
                if state.text_at_end:
                    sample.detokenizer.step(sample.token_ids)
                ended.append(sample)
        return ended

    def _delta(self, state: _RequestState, sample: _SampleState) -> CompletionOutput:
        end = sample.visible_end(state.holdback)
        completion = CompletionOutput(
            index=sample.index,
            text=sample.text[sample.sent_chars : end],
            token_ids=sample.token_ids[sample.sent_tokens :],
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=sample.logprobs[sample.sent_tokens :] if sample.want_logprobs else None,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )
        sample.sent_chars = end
        sample.sent_tokens = len(sample.token_ids)
        return completion

    @staticmethod
    def _whole(state: _RequestState, sample: _SampleState) -> CompletionOutput:
        return CompletionOutput(
            index=sample.index,
            text=sample.text[: sample.visible_end(state.holdback)],
            token_ids=list(sample.token_ids),
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=list(sample.logprobs) if sample.want_logprobs else None,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    def _beam_output(
        self, state: _RequestState, beams: list[BeamResult], error: str | None, now: float
    ) -> RequestOutput:
        skip = state.params.skip_special_tokens
        completions = [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(beam.token_ids, skip) if self.tokenizer else "",
                token_ids=beam.token_ids,
                cumulative_logprob=beam.cumulative_logprob,
                logprobs=None,
                finish_reason=beam.finish_reason,
                score=beam.score,
            )
            for i, beam in enumerate(beams)
        ]
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            completions,
            True,
            self._metrics(state, now),
            error,
            num_cached_tokens=state.num_cached_tokens,
        )

    @staticmethod
    def _failed(state: _RequestState, error: str) -> RequestOutput:
        """The final output of a request whose outputs could not be built."""
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids, [], True, None, error
        )

    @staticmethod
    def _metrics(state: _RequestState, now: float) -> RequestMetrics:
        return RequestMetrics(
            state.arrival_time, state.first_scheduled_time, state.first_token_time, now
        )


def _by_index(sample: _SampleState) -> int:
    return sample.index


def _best(completions: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """best_of: the n samples of highest cumulative logprob, best first, indexed 0..n-1
    (a sample that ended before its first token, without a logprob, ranks last)."""
    ranked = sorted(
        completions,
        key=lambda c: -math.inf if c.cumulative_logprob is None else c.cumulative_logprob,
        reverse=True,
    )[:n]
    for index, completion in enumerate(ranked):
        completion.index = index
    return ranked


def _without_stop_token(sample: _SampleState, params: SamplingParams) -> list[int]:
    """The tokens whose text is output: all but a stop token, unless it is to be included."""
    if isinstance(sample.stop_reason, int) and not params.include_stop_str_in_output:
        return sample.token_ids[:-1]
    return sample.token_ids
