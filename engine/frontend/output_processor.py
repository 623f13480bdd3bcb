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

Applying a step (`update`) and building outputs (`build`) are apart: `update` only says which
requests have an output due, and the RequestOutput is built when its consumer takes it. A
server's stream whose client reads slower than the engine steps then gets one output holding
every step since it last read, built once, instead of an output per step merged later.
`process` does both at once (the offline engine).
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
    finish_sent: bool = False  # DELTA: an output carried its finish

    def visible_end(self, holdback: int) -> int:
        """How much of the text may be shown: all once finished, else all but the holdback."""
        end = len(self.detokenizer.text) if self.text_end is None else self.text_end
        if self.finish_reason is not None:
            return end
        return max(end - holdback, self.sent_chars)

    @property
    def unsent(self) -> bool:
        """DELTA: whether tokens or the finish of this sample have not been output yet."""
        return len(self.token_ids) > self.sent_tokens or (
            self.finish_reason is not None and not self.finish_sent
        )


@dataclass(eq=False)
class RequestState:
    """One request's front-end state, and the handle `update` gives out for a
    request whose output is due (read `request_id` and `error`; build the output with
    `OutputProcessor.build`). A finished request's state outlives its place in the
    processor until its last output is built."""

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
    # Set once the request ended: when, how (an error message), and a beam search's result.
    finished: bool = False
    finished_time: float | None = None
    error: str | None = None
    beams: list[BeamResult] | None = None
    failed: bool = False  # its outputs could not be applied: the final output is the error alone

    @property
    def all_samples_finished(self) -> bool:
        return len(self.samples) == self.params.num_sequences and all(
            s.finish_reason is not None for s in self.samples.values()
        )


@dataclass
class UpdatedRequests:
    """What one batch of core outputs changed: the requests with an output due (to `build`),
    the ids of those that ended, and what the core must stop (samples that hit a stop
    string; requests whose outputs could not be applied)."""

    ready: list[RequestState] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    sample_aborts: list[SampleAbort] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


@dataclass
class ProcessedOutputs:
    """`UpdatedRequests` with the due outputs built (`OutputProcessor.process`)."""

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
        self._requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | BeamSearchParams,
        arrival_time: float,
    ) -> None:
        stops = params.stop_strings
        holdback = max((len(s) for s in stops), default=1) - 1
        if isinstance(params, BeamSearchParams) or params.ranks_samples:
            kind = RequestOutputKind.FINAL_ONLY  # ranked whole: only the end counts
        else:
            kind = params.output_kind
        text_at_end = kind is RequestOutputKind.FINAL_ONLY and not stops
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, arrival_time, holdback, kind, text_at_end
        )
        if params.prompt_logprobs is not None:
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
        """`update` with every due output built at once."""
        updated = self.update(outputs)
        built = [self.build(state) for state in updated.ready]
        return ProcessedOutputs(
            [output for output in built if output is not None],
            updated.sample_aborts,
            updated.aborts,
        )

    def update(self, outputs: list[EngineCoreOutput]) -> UpdatedRequests:
        """Applies one step's core outputs; returns the requests with an output due. Outputs
        of unknown (finished, forgotten) requests are ignored; a request whose outputs cannot
        be applied fails alone (its output is then the error)."""
        result = UpdatedRequests()
        now = time.monotonic()
        for output in outputs:
            state = self._requests.get(output.request_id)
            if state is None:
                continue
            try:
                due = self._update_one(state, output, result, now)
            except Exception as exc:  # noqa: BLE001 -- one request's fault is its own
                logger.error("request %s failed", state.request_id, exc_info=exc)
                if self._requests.pop(state.request_id, None) is not None:
                    result.finished.append(state.request_id)
                if not output.finished:
                    result.aborts.append(state.request_id)
                state.finished, state.failed = True, True
                state.error = f"{type(exc).__name__}: {exc}"
                due = True
            if due:
                result.ready.append(state)
        return result

    def build(self, state: RequestState) -> RequestOutput | None:
        """The output of a request `update` found due: for a stream (DELTA), what its samples
        gained since the previous one (None if nothing is due any more); else the whole
        output so far. Call once per taking: building a delta marks it sent."""
        if state.failed:  # its outputs could not be applied: the final output is the error alone
            return RequestOutput(
                state.request_id, state.prompt, state.prompt_token_ids, [], True, None, state.error
            )
        kind = state.output_kind
        finished = state.finished
        prompt_logprobs, ranks = state.prompt_logprobs, state.prompt_token_ranks
        if kind is RequestOutputKind.DELTA:
            samples = [s for s in state.samples.values() if s.unsent and self._due(s)]
            if not samples and not finished:
                return None
            if len(samples) > 1:
                samples.sort(key=_by_index)
            completions = [self._completion(state, s, True) for s in samples]
            if state.prompt_logprobs_sent:  # the first output carried them
                prompt_logprobs = ranks = None
            state.prompt_logprobs_sent = True
        elif kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        elif state.beams is not None:  # (beam search is FINAL_ONLY)
            completions = self._beam_completions(state, state.beams)
        else:
            completions = [
                self._completion(state, s, False)
                for s in sorted(state.samples.values(), key=_by_index)
            ]
            if isinstance(state.params, SamplingParams) and state.params.ranks_samples:
                completions = _best(completions, state.params.n)
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            completions,
            finished,
            self._metrics(state) if finished else None,
            state.error,
            prompt_logprobs,
            ranks,
            state.num_cached_tokens,
        )

    # -- one request -------------------------------------------------------------------------

    def _update_one(
        self,
        state: RequestState,
        output: EngineCoreOutput,
        result: UpdatedRequests,
        now: float,
    ) -> bool:
        """Applies one request's core output, received at `now`, noting its stop-string
        sample aborts and its end in `result`; returns whether an output of it is due."""
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
        kind = state.output_kind
        due = False
        any_sample_finished = False
        for delta in output.samples:
            sample = self._sample(state, delta.index)
            if sample.finish_reason is not None:
                continue  # finished here (a stop string) before the core heard of it
            if delta.new_token_ids and state.first_token_time is None:
                state.first_token_time = now
            self._apply(state, sample, delta)
            if sample.finish_reason is not None:
                any_sample_finished = True
                if delta.finish_reason is None:
                    result.sample_aborts.append(SampleAbort(state.request_id, sample.index))
            if kind is RequestOutputKind.CUMULATIVE or (
                kind is RequestOutputKind.DELTA and self._due(sample)
            ):
                due = True
        if not (output.finished or (any_sample_finished and state.all_samples_finished)):
            return due
        del self._requests[state.request_id]
        result.finished.append(state.request_id)
        state.finished, state.finished_time = True, now
        state.error = output.error
        state.beams = output.beams
        if output.beams is None:
            self._end_unfinished(state, output.error)
        return True

    def _sample(self, state: RequestState, index: int) -> _SampleState:
        sample = state.samples.get(index)
        if sample is None:
            params = state.params
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            sample = state.samples[index] = _SampleState(
                index, detokenizer, params.logprobs is not None
            )
        return sample

    def _apply(self, state: RequestState, sample: _SampleState, delta: SampleDelta) -> None:
        """Appends a delta's tokens, matching stop strings token by token; the core's own
        finish (a token rule) applies unless a stop string ended the sample first. With
        text_at_end the tokens stay undecoded until that finish decodes the whole text, as
        stepping would have built it."""
        params = state.params
        assert isinstance(params, SamplingParams)  # beams never reach samples
        sample.cumulative_logprob = delta.cumulative_logprob
        if not params.stop_strings:  # nothing to match: the tokens' text in one step
            sample.token_ids += delta.new_token_ids
            if sample.want_logprobs and delta.new_logprobs is not None:
                sample.logprobs += delta.new_logprobs
            if delta.finish_reason is None and not state.text_at_end:
                sample.detokenizer.step(sample.token_ids)
        else:
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
                if new_text and len(sample.token_ids) >= params.min_tokens and not stop_token:
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
        if delta.finish_reason is not None:  # (flushing steps too, leaving out a stop token's)
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

    def _end_unfinished(self, state: RequestState, error: str | None) -> None:
        """Gives every sample still open at the request's end (never started: a request
        aborted before its prompt forked into n samples) the request's end."""
        reason = "error" if error is not None else "abort"
        for index in range(state.params.num_sequences):
            sample = self._sample(state, index)
            if sample.finish_reason is None:
                sample.finish_reason = reason
                if state.text_at_end:
                    sample.detokenizer.step(sample.token_ids)

    @staticmethod
    def _completion(state: RequestState, sample: _SampleState, delta: bool) -> CompletionOutput:
        """A sample's output: for a stream (`delta`), what it gained since it was last sent,
        which is then marked sent; else all of it so far (lists of its own either way)."""
        end = sample.visible_end(state.holdback)
        chars, tokens = (sample.sent_chars, sample.sent_tokens) if delta else (0, 0)
        completion = CompletionOutput(
            index=sample.index,
            text=sample.detokenizer.text[chars:end],
            token_ids=sample.token_ids[tokens:],
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=sample.logprobs[tokens:] if sample.want_logprobs else None,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )
        if delta:
            sample.sent_chars = end
            sample.sent_tokens = len(sample.token_ids)
            sample.finish_sent = sample.finish_reason is not None
        return completion

    def _beam_completions(
        self, state: RequestState, beams: list[BeamResult]
    ) -> list[CompletionOutput]:
        skip = state.params.skip_special_tokens
        return [
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

    @staticmethod
    def _metrics(state: RequestState) -> RequestMetrics:
        return RequestMetrics(
            state.arrival_time, state.first_scheduled_time, state.first_token_time,
            state.finished_time,
        )  # fmt: skip


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
