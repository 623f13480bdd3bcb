"""Sequences and sequence groups: the engine's per-request state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from octavo.engine.core.beam_state import BeamState
from octavo.engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # processing this request raised; the others went on

    @property
    def finished(self) -> bool:
        # Identity tests: an Enum's __hash__ runs in Python, a set lookup would cost more.
        return self is not SequenceStatus.WAITING and self is not SequenceStatus.RUNNING

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False, slots=True)
class Sequence:
    """One token stream: the prompt plus what has been generated for it.

    `num_computed_tokens` counts the tokens whose K/V are in the cache (or will be once the
    steps already scheduled have run); the tokens after it are what the next step must compute
    (a prefill chunk, or the one decode token). Preemption by recompute resets it to 0 and
    keeps the tokens. `num_pending_tokens` counts tokens sampled by scheduled steps whose
    values the core has not received yet: with async scheduling, a decode is scheduled for
    the pending token (the worker feeds it from the device). `index` is the sample's place
    among its request's outputs (fixed at creation: the n samples are 0..n-1).
    """

    seq_id: int
    prompt_token_ids: list[int]
    index: int = 0
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    _status: SequenceStatus = field(default=SequenceStatus.WAITING, init=False, repr=False)
    # Kept by the `status` setter: read for every sequence of every step, where a property
    # comparing enum members costs ten times an attribute read.
    is_finished: bool = field(default=False, init=False)
    cumulative_logprob: float = 0.0
    stop_reason: int | None = None  # the stop token id that finished the sequence
    # Draft tokens proposed to follow `token_ids` (speculative decoding), verified by the
    # next step that schedules them.
    spec_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter it runs with (0: the base model); its K/V depend on it.
    lora_int_id: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def status(self) -> SequenceStatus:
        return self._status

    @status.setter
    def status(self, status: SequenceStatus) -> None:
        self._status = status
        self.is_finished = status.finished

    def append_token(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def fork(self, seq_id: int, index: int) -> Sequence:
        """A copy sharing nothing mutable with this one (block sharing is the BlockManager's);
        `index` is the child's sample index."""
        child = Sequence(seq_id, self.prompt_token_ids, index, lora_int_id=self.lora_int_id)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        return child


@dataclass(eq=False)
class SequenceGroup:
    """All sequences of one request: one before its prompt is computed, `n` after it forks
    (sampling), or the live beams (beam search, with its state in `beam`).

    The group is the unit of admission and preemption; its sequences are scheduled together.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | BeamSearchParams
    arrival_time: float
    # The token stop rules' two quantities (see engine/stop_rules.py): only a token in
    # `stop_token_ids` (EOS unless ignored, and the request's own) or a length of
    # `max_num_tokens` (prompt included) can end a sample, so the stop rules run for those
    # alone.
    stop_token_ids: frozenset[int]
    max_num_tokens: int
    seqs: list[Sequence] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    beam: BeamState | None = None
    error: str | None = None  # why the request failed (FINISHED_ERROR), for its client
    # Prompt logprobs: positions below this were scheduled for them already (a recompute
    # after preemption does not score them again).
    prompt_logprobs_next: int = 0
    # Prompt tokens found in the prefix cache at first admission (None: not admitted yet).
    num_cached_tokens: int | None = None
    # Draft tokens it may speculate a step (0: none; see engine/speculative.py).
    num_speculative_tokens: int = 0
    # The LoRA adapter its sequences run with (0: the base model).
    lora_int_id: int = 0
    # What the scheduling policy orders it by (request_queue.py): the priority policy's
    # priority (lower first), the fair policy's user.
    priority: int = 0
    user: str = ""
    # The params' num_sequences (n, best_of or beam_width), as an attribute: the scheduler
    # reads it for every running request of every step.
    num_sequences: int = field(init=False)
    # Nobody reads this request's tokens before a sample ends (its front end wants the final
    # output only, matches no stop strings and wants no per-token logprobs): a sample's
    # tokens leave the core at once, when it finishes, not one step at a time.
    final_only: bool = field(init=False)
    # Asks for prompt logprobs: an attribute, read for every scheduled sequence of a step.
    wants_prompt_logprobs: bool = field(init=False)
    # What the front end derived from its params (ProcessedPrompt's): the structured-output
    # grammar, and the token ids of its bad words.
    grammar: str | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # A beam search's structured-output grammar (None: unconstrained, or not a beam search).
    beam_grammar: str | None = field(init=False)
    # Needs every token on the host before its next step is scheduled, so steps run in
    # order while it runs (no async scheduling): beam search, which ranks on the host; bad
    # words, matched against the output so far; prompt logprobs, read as they are computed;
    # structured outputs, whose next mask follows from the last token; speculation, whose
    # next draft follows from it.
    needs_sync_steps: bool = field(init=False)

    def __post_init__(self) -> None:
        self.num_sequences = self.sampling_params.num_sequences
        params = self.sampling_params
        self.final_only = (
            isinstance(params, SamplingParams)
            and params.output_kind is RequestOutputKind.FINAL_ONLY
            and not params.stop_strings
            and params.logprobs is None
        )
        self.wants_prompt_logprobs = params.prompt_logprobs is not None
        self.beam_grammar = self.grammar if isinstance(params, BeamSearchParams) else None
        self.needs_sync_steps = isinstance(params, BeamSearchParams) or bool(
            self.num_speculative_tokens
            or self.bad_words_token_ids
            or self.wants_prompt_logprobs
            or self.grammar
        )

    @property
    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def num_unfinished_seqs(self) -> int:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, without a generator
            return 0 if seqs[0].is_finished else 1
        return sum(1 for s in seqs if not s.is_finished)

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs[0].is_finished
        return all(seq.is_finished for seq in seqs)

    @property
    def sampling(self) -> SamplingParams:
        """The parameters of a sampling (not beam search) request."""
        assert isinstance(self.sampling_params, SamplingParams), "a beam search request"
        return self.sampling_params

    @property
    def needs_fork(self) -> bool:
        """True until the prompt of a sampling request has been sampled into `n` sequences."""
        return self.beam is None and len(self.seqs) < self.num_sequences
