"""Continuous batching by token budget: decode-first, chunked prefill, preemption by recompute."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from octavo.engine.beam_search import BeamSearch
from octavo.engine.block_manager import BlockManager
from octavo.engine.sampler import ModelRunnerOutput, SamplerOutput
from octavo.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from octavo.engine.stop_checker import StopChecker

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSequence:
    """One sequence's work in a step.

    The step computes tokens [num_computed, num_computed + num_new_tokens) of `seq`. When that
    reaches the end of its tokens, the logits of the last one are sampled once for every
    sequence in `sample_seqs`: `[seq]`, or `seq` and the children forked from it this step
    (the prompt of an n > 1 request is computed once, then sampled n times).
    """

    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int
    sample_seqs: list[Sequence]


@dataclass
class SchedulerOutput:
    """A step's plan: sequences with one query token come first (the decode fast path)."""

    scheduled: list[ScheduledSequence]
    blocks_to_copy: list[tuple[int, int]]
    preempted: list[SequenceGroup] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


class Scheduler:
    """Decides each step which tokens of which sequences to compute, and applies the results.

    Every step: running groups, in admission order, get their remaining tokens (one per decoding
    sequence, a chunk for a prompt still being prefilled) under `max_num_batched_tokens`; when
    the BlockManager cannot hold them, the most recently admitted group is preempted (its
    blocks freed, its tokens kept, recomputed later from the front of the waiting queue).
    Then waiting groups are admitted, in arrival order, while budget, `max_num_seqs` and free
    blocks allow; a prompt longer than the remaining budget is prefilled in chunks.
    """

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, stop_checker: StopChecker
    ):
        self.config = config
        self.block_manager = block_manager
        self.stop_checker = stop_checker
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompts admitted (each counted once)
        self.num_generation_tokens = 0  # tokens sampled
        self._seq_ids = itertools.count()
        self.beam_search = BeamSearch(block_manager, self.new_seq_id)

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    # -- requests ----------------------------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Finishes a request as aborted and frees its blocks at once; None if unknown."""
        for queue in (self.waiting, self.running):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    group.finished_time = time.monotonic()
                    for seq in group.unfinished_seqs:
                        seq.status = SequenceStatus.FINISHED_ABORTED
                        self.block_manager.free(seq)
                    return group
        return None

    def abort_sample(self, request_id: str, index: int) -> SequenceGroup | None:
        """Finishes sample `index` of a request (the front end matched one of its stop
        strings) and frees its blocks; the request's other samples go on. Returns the group
        if that was its last unfinished sample (it is then removed), else None."""
        for queue in (self.running, self.waiting):
            for group in queue:
                if group.request_id != request_id:
                    continue
                for seq in group.unfinished_seqs:
                    if seq.index == index:
                        seq.status = SequenceStatus.FINISHED_ABORTED
                        self.block_manager.free(seq)
                if not group.is_finished:
                    return None
                queue.remove(group)
                group.finished_time = time.monotonic()
                return group
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.unfinished_seqs) for g in self.running)

    # -- scheduling --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[SequenceGroup] = []
        index = 0
        while index < len(self.running) and budget > 0:
            group = self.running[index]
            plan = self._plan(group, budget)
            while not self._fits(plan):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is group:
                    break
            if group in preempted:
                break
            budget -= self._commit(group, plan, scheduled)
            index += 1

        num_seqs = self.num_running_seqs
        while self.waiting and budget > 0 and not preempted:
            group = self.waiting[0]
            seqs = group.unfinished_seqs
            if num_seqs + max(len(seqs), group.sampling_params.n) > self.config.max_num_seqs:
                break
            plan = self._plan(group, budget)
            if not self._fits(plan):
                break
            self.waiting.popleft()
            self.running.append(group)
            if group.first_scheduled_time is None:
                group.first_scheduled_time = time.monotonic()
                self.num_prompt_tokens += len(group.prompt_token_ids)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            num_seqs += max(len(seqs), group.sampling_params.n)
            budget -= self._commit(group, plan, scheduled)

        # Stable: decodes first, each part still in admission order.
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return SchedulerOutput(
            scheduled=scheduled,
            blocks_to_copy=self.block_manager.take_copies(),
            preempted=preempted,
        )

    def _plan(self, group: SequenceGroup, budget: int) -> list[tuple[Sequence, int]]:
        """How many tokens each unfinished sequence of `group` computes within `budget`."""
        if group.beam is not None and len(group.unfinished_seqs) > 1:
            return self._plan_beams(group, budget)
        plan = []
        for seq in group.unfinished_seqs:
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                break
            plan.append((seq, num_new))
            budget -= num_new
        return plan

    @staticmethod
    def _plan_beams(group: SequenceGroup, budget: int) -> list[tuple[Sequence, int]]:
        """Live beams decode together: one step ranks candidates across all of them.

        After a preemption they are recomputed sharing the prompt again: the first beam
        computes the prompt, the others fork it at the prompt's end (see `_commit`), then each
        computes its own tokens but the last, which all beams compute in one decode step.
        """
        beams = group.unfinished_seqs
        if all(b.num_uncomputed_tokens == 1 for b in beams):
            return [(b, 1) for b in beams] if budget >= len(beams) else []
        first, prompt_len = beams[0], len(group.prompt_token_ids)
        if first.num_computed_tokens < prompt_len:
            return [(first, min(prompt_len - first.num_computed_tokens, budget))]
        plan = []
        for beam in beams:
            num_new = min(beam.num_uncomputed_tokens - 1, budget)
            if num_new > 0:
                plan.append((beam, num_new))
                budget -= num_new
        return plan

    def _fits(self, plan: list[tuple[Sequence, int]]) -> bool:
        bm = self.block_manager
        return sum(bm.num_new_blocks_needed(s, n) for s, n in plan) <= bm.num_free_blocks

    def _commit(
        self,
        group: SequenceGroup,
        plan: list[tuple[Sequence, int]],
        scheduled: list[ScheduledSequence],
    ) -> int:
        """Allocates the planned slots, forks n > 1 samples off a completed prompt; returns
        the number of tokens scheduled."""
        for seq, num_new in plan:
            self.block_manager.append_slots(seq, num_new)
            sample_seqs = []
            if num_new == seq.num_uncomputed_tokens:
                sample_seqs = [seq]
                if group.needs_fork:
                    sample_seqs += self._fork(group, seq)
            elif group.beam is not None and seq.num_computed_tokens + num_new == len(
                group.prompt_token_ids
            ):
                self._share_recomputed_prompt(group, seq)
            scheduled.append(ScheduledSequence(group, seq, num_new, sample_seqs))
        return sum(n for _, n in plan)

    def _fork(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        children = []
        while group.needs_fork:
            index = len(group.seqs)
            child = parent.fork(self.new_seq_id(), group.make_generator(index), index)
            self.block_manager.fork(parent, child)
            group.seqs.append(child)
            children.append(child)
        return children

    def _share_recomputed_prompt(self, group: SequenceGroup, first: Sequence) -> None:
        """The other beams of a recomputed group take the prompt blocks `first` is filling."""
        for beam in group.unfinished_seqs:
            if beam is not first and beam.num_computed_tokens == 0:
                self.block_manager.fork(first, beam)
                beam.num_computed_tokens = len(group.prompt_token_ids)

    def _preempt(self, group: SequenceGroup) -> None:
        for seq in group.unfinished_seqs:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        group.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(group)

    # -- results -----------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[SequenceGroup]:
        """Appends the sampled tokens, applies stop rules, advances beam searches, frees
        finished sequences; returns the groups that progressed this step, finished included.

        Whatever raises while one group is updated (sampling bookkeeping, stop checks, beam
        arithmetic) fails that group alone (`fail`); the others are updated as usual."""
        now = time.monotonic()
        sampled = result.sampled
        row = beam_row = 0
        updated: dict[int, SequenceGroup] = {}
        beam_rows: dict[int, dict[int, int]] = {}  # group -> seq_id -> row of beam_candidates
        for item in output.scheduled:
            group = item.group
            if item.sample_seqs:
                updated[id(group)] = group
            if group.beam is not None:
                item.seq.num_computed_tokens += item.num_new_tokens
                for seq in item.sample_seqs:
                    beam_rows.setdefault(id(group), {})[seq.seq_id] = beam_row
                    beam_row += 1
                continue
            first_row, row = row, row + len(item.sample_seqs)
            if group.is_finished:  # failed earlier in this step
                continue
            try:
                self._append_samples(group, item, sampled, first_row, now)
            except Exception as exc:  # noqa: BLE001 -- one request's fault is its own
                self.fail(group, exc)
                updated[id(group)] = group
        self.num_generation_tokens += row
        for key, rows in beam_rows.items():
            group = updated[key]
            if group.is_finished:
                continue
            beams = group.unfinished_seqs
            try:
                assert result.beam_candidates is not None, "beam rows without candidates"
                candidates = result.beam_candidates.rows([rows[b.seq_id] for b in beams])
                self.beam_search.step(group, candidates)
            except Exception as exc:  # noqa: BLE001 -- one request's fault is its own
                self.fail(group, exc)
                continue
            self.num_generation_tokens += len(beams)
            if group.first_token_time is None:
                group.first_token_time = now
            if group.is_finished:
                group.finished_time = now
        if any(g.is_finished for g in updated.values()):
            self.running = [g for g in self.running if not g.is_finished]
        return list(updated.values())

    def _append_samples(
        self,
        group: SequenceGroup,
        item: ScheduledSequence,
        sampled: SamplerOutput,
        first_row: int,
        now: float,
    ) -> None:
        item.seq.num_computed_tokens += item.num_new_tokens
        for row, seq in enumerate(item.sample_seqs, start=first_row):
            seq.num_computed_tokens = item.seq.num_computed_tokens
            seq.append_token(
                sampled.token_ids[row], sampled.logprobs[row], sampled.top_logprobs[row]
            )
            self._check_stop(group, seq)
            if seq.is_finished:
                group.finished_time = now
        if item.sample_seqs and group.first_token_time is None:
            group.first_token_time = now

    def fail(self, group: SequenceGroup, exc: BaseException) -> None:
        """Ends a request whose processing raised: its unfinished sequences finish with
        FINISHED_ERROR and free their blocks; `group.error` says why, for its client."""
        logger.error("request %s failed", group.request_id, exc_info=exc)
        group.error = f"{type(exc).__name__}: {exc}"
        group.finished_time = time.monotonic()
        for seq in group.unfinished_seqs:
            seq.status = SequenceStatus.FINISHED_ERROR
            self.block_manager.free(seq)
        if group in self.running:
            self.running.remove(group)

    def _check_stop(self, group: SequenceGroup, seq: Sequence) -> None:
        decision = self.stop_checker.check(seq, group.sampling)
        if decision is None:
            return
        seq.status = (
            SequenceStatus.FINISHED_LENGTH
            if decision.finish_reason == "length"
            else SequenceStatus.FINISHED_STOPPED
        )
        assert not isinstance(decision.stop_reason, str), "token rules match no text"
        seq.stop_reason = decision.stop_reason
        self.block_manager.free(seq)
