"""Continuous batching by token budget: decode-first, chunked prefill, preemption by recompute."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from octavo.engine.core.beam_search import BeamSearch
from octavo.engine.core.block_manager import BlockManager
from octavo.engine.core.request_queue import RequestQueue, create_request_queue
from octavo.engine.core.scheduled_step import CoreEntry, SampleRow, ScheduledFields, ScheduledStep
from octavo.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from octavo.engine.core.step_updater import SchedulerUpdate, StepUpdater
from octavo.engine.core.stop_checker import StopChecker
from octavo.engine.core.user_stats import UserStatsTracker
from octavo.engine.step_io import (
    ModelRunnerOutput,
    NewSampledSequence,
    PromptLogprobsSpan,
    ScheduledSequence,
    SchedulerOutput,
)


class _StepBuilder:
    """The sequences of the step being scheduled, decodes apart from the rest (one query
    token first in the batch), each with its core entry."""

    def __init__(self) -> None:
        self.decodes: list[ScheduledFields] = []
        self.prefills: list[ScheduledFields] = []
        self.decode_entries: list[CoreEntry] = []
        self.prefill_entries: list[CoreEntry] = []
        self.num_draft_tokens = 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    # Waiting requests are admitted at most every this many steps while others run (at once
    # when nothing runs): the steps between stay decode-only (EngineConfig.prefill_interval).
    prefill_interval: int = 1
    # Distinct LoRA adapters among the running requests (the model's adapter slots).
    max_loras: int = 1
    # Whom to admit and preempt next (request_queue.py), and the fair policy's weights.
    scheduling_policy: str = "fcfs"
    fair_prompt_token_weight: float = 1.0
    fair_output_token_weight: float = 2.0


class Scheduler:
    """Decides each step which tokens of which sequences to compute, and applies the results.

    Every step: running groups, in admission order, get the tokens they still need, by one rule
    for prompts and decodes (`_schedule_group`), under `max_num_batched_tokens`; when
    the BlockManager cannot hold them, a group not yet scheduled is preempted (its blocks
    freed, its tokens kept, recomputed later from the waiting queue; which group, the
    policy's `RequestQueue` says: under fcfs the most recently admitted). Then waiting groups
    are admitted, in the policy's order (fcfs: arrival), while budget, `max_num_seqs` and free
    blocks allow; a prompt longer than the remaining budget is prefilled in chunks. While
    groups run, admissions happen at most every `prefill_interval` steps. A policy that
    preempts to admit (priority, fair) does so at the start of a step that admits, before
    the running groups are scheduled.

    A row that samples makes a token pending (`Sequence.num_pending_tokens`) until `update`
    receives it. `schedule` may run before the previous step's `update` (async scheduling):
    a pending token then counts as a token to compute (the worker feeds it from the device),
    a sequence whose pending token reaches its length limit is not scheduled again, a
    preempted group with a token in flight waits for it, and `update` drops a token that
    arrives for a finished sequence.
    """

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, stop_checker: StopChecker
    ):
        self.config = config
        self.block_manager = block_manager
        self.waiting: RequestQueue = create_request_queue(
            config.scheduling_policy,
            config.fair_prompt_token_weight,
            config.fair_output_token_weight,
        )
        self.running: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompts admitted (each counted once)
        self.users = UserStatsTracker()
        # The id of each new sequence (requests', forks', beams'), in order.
        self.new_seq_id: Callable[[], int] = itertools.count().__next__
        # Whether a request with a LoRA adapter ever came: only then does a step list the
        # adapters of its new tables (SchedulerOutput.lora_int_ids).
        self._saw_adapters = False
        self._num_running_seqs: int | None = None  # None: to be recounted
        self._steps_since_admission = 0  # schedule() calls since one admitted a group
        # Per sequence sampled so far (until it finishes): its row (see _sample_row).
        self._sample_rows: dict[int, SampleRow] = {}
        self._new_sampled: list[NewSampledSequence] = []  # since the last schedule()
        self._finished_seq_ids: list[int] = []  # sampled sequences finished since then
        self._num_prompt_logprobs_spans = 0  # in the step being scheduled
        self.num_prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_cache_hits = 0  # of which were found
        self.beam_search = BeamSearch(block_manager, self.new_seq_id)
        self.updater = StepUpdater(stop_checker, self.beam_search, self._finish, self._forget)

    # -- requests ----------------------------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        self.waiting.add(group, self.running)
        self._saw_adapters = self._saw_adapters or bool(group.lora_int_id)

    def abort(self, group: SequenceGroup) -> None:
        """Finishes a queued request (waiting or running) as aborted and frees its blocks at
        once."""
        self._dequeue(group)
        for seq in group.unfinished_seqs:
            self._finish(seq, SequenceStatus.FINISHED_ABORTED)

    def abort_sample(self, group: SequenceGroup, index: int) -> bool:
        """Finishes sample `index` of a queued request (the front end matched one of its
        stop strings) and frees its blocks; the request's other samples go on. Returns
        whether that was its last unfinished sample (the request is then dequeued)."""
        for seq in group.unfinished_seqs:
            if seq.index == index:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        if group.is_finished:
            self._dequeue(group)
        return group.is_finished

    def _dequeue(self, group: SequenceGroup) -> None:
        """Takes a group out of its queue. The caller holds the group (the engine core finds
        it by request id), so only the queue's own scan remains, in C: a Python loop over
        thousands of waiting requests per abort made a burst of disconnects stall the core.
        """
        if group in self.running:  # at most max_num_seqs groups
            self.running.remove(group)
        else:
            self.waiting.remove(group)
        self.users.ended(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running_seqs(self) -> int:
        """Unfinished sequences of the running groups; recounted only after a change to
        them (an admission, a fork, a finish, a preemption), not for a step's new blocks
        (the stats of every step read it)."""
        if self._num_running_seqs is None:
            self._num_running_seqs = sum(g.num_unfinished_seqs for g in self.running)
        return self._num_running_seqs

    # -- scheduling --------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        """Plans one step and advances every scheduled sequence's `num_computed_tokens` past
        the tokens it schedules (their K/V are in the cache once the step has run)."""
        budget = self.config.max_num_batched_tokens
        self._num_prompt_logprobs_spans = 0
        step = _StepBuilder()
        preempted: list[SequenceGroup] = []
        # A policy that preempts to admit does so before the running requests are scheduled.
        victims: list[SequenceGroup] = []
        if self.waiting and self.waiting.preempts_to_admit and self._admits():
            victims = self._preempt_to_admit(budget)
        index = 0
        # Most running groups are one sample's decode: a sequence with a cached row (sampled
        # from itself), one token to compute and a slot for it. That case is the rule
        # (`_schedule_group`) with its answers read off the cache, without building a plan.
        sample_rows, allocate_slots = self._sample_rows, self.block_manager.allocate_slots
        decodes, decode_entries = step.decodes, step.decode_entries
        while index < len(self.running) and budget > 0:
            group = self.running[index]
            seqs = group.seqs
            if len(seqs) == 1:
                seq = seqs[0]
                cached = sample_rows.get(seq.seq_id)
                start = seq.num_computed_tokens
                known = len(seq.token_ids) + seq.num_pending_tokens
                if (
                    cached is not None
                    and known - start == 1
                    and known < group.max_num_tokens
                    and not seq.spec_token_ids
                    and allocate_slots(seq, 1)
                ):
                    seq.num_computed_tokens = start + 1
                    seq.num_pending_tokens += 1
                    sample_seq_ids, entry = cached
                    decodes.append(
                        (seq.seq_id, start, 1, seq.token_ids[start : start + 1], sample_seq_ids)
                    )
                    decode_entries.append(entry)
                    budget -= 1
                    index += 1
                    continue
            scheduled = self._schedule_group(group, budget, step)
            if scheduled is None:
                scheduled = self._preempt_for(index, budget, step, preempted)
                if scheduled is None:
                    break
            budget -= scheduled
            index += 1

        admits = self._admits()
        self._steps_since_admission += 1
        num_seqs = self.num_running_seqs if self.waiting and admits else 0
        max_num_seqs = self.config.max_num_seqs
        # LoRA: the running requests' adapters, and the requests passed over this step
        # because theirs found no slot (they keep their place at the queue's head).
        adapters = self._running_adapters() if self._saw_adapters and admits else set()
        passed_over: list[SequenceGroup] = []
        while admits and self.waiting and budget > 0 and not preempted:
            group = self.waiting.peek()
            if group in victims:
                break  # preempted this step to admit another: not taken back at once
            seqs = group.unfinished_seqs
            lora_int_id = group.lora_int_id
            no_slot = len(adapters) >= self.config.max_loras
            if lora_int_id and lora_int_id not in adapters and no_slot:
                passed_over.append(self.waiting.pop())
                continue
            if num_seqs + max(len(seqs), group.num_sequences) > max_num_seqs:
                break
            if any(seq.num_pending_tokens for seq in seqs):
                break  # preempted with a token in flight: recomputed once it has arrived
            num_cached = self._take_cached_prefix(group, seqs)
            scheduled = self._schedule_group(group, budget, step)
            if scheduled is None:
                if num_cached:  # it does not fit after all: _take_cached_prefix undone
                    self.block_manager.release_prefix(seqs[0])
                    seqs[0].num_computed_tokens = 0
                break
            budget -= scheduled
            if num_cached is not None:  # vLLM's prefix-cache counters, in tokens
                self.num_prefix_cache_queries += len(seqs[0].token_ids)
                self.num_prefix_cache_hits += num_cached
            self.waiting.pop()
            self.running.append(group)
            self._num_running_seqs = None
            if group.first_scheduled_time is None:
                group.first_scheduled_time = time.monotonic()
                group.num_cached_tokens = num_cached or 0  # 0 without prefix caching
                self.num_prompt_tokens += len(group.prompt_token_ids)
                self.waiting.charge(group, len(group.prompt_token_ids))
                self.users.admitted(group)
            for seq in group.unfinished_seqs:  # the samples forked off its prompt too
                seq.status = SequenceStatus.RUNNING
            num_seqs += max(len(seqs), group.num_sequences)
            self._steps_since_admission = 0
            if lora_int_id:
                adapters.add(lora_int_id)
        for group in reversed(passed_over):
            self.waiting.prepend(group)

        bm, beams = self.block_manager, self.beam_search
        changed, freed = bm.take_changes()
        output = SchedulerOutput(
            scheduled=[ScheduledSequence(*fields) for fields in step.decodes + step.prefills],
            blocks_to_copy=bm.take_copies(),
            block_tables={seq_id: list(bm.block_tables[seq_id]) for seq_id in changed},
            lora_int_ids=self._lora_int_ids(changed) if changed and self._saw_adapters else {},
            new_sampled=self._new_sampled,
            freed_seq_ids=freed,
            finished_seq_ids=self._finished_seq_ids,
            new_constrained_beams=beams.new_constrained_beams,
            beam_choices=beams.beam_choices,
            has_prompt_logprobs=self._num_prompt_logprobs_spans > 0,
            num_draft_tokens=step.num_draft_tokens,
        )
        self._new_sampled, self._finished_seq_ids = [], []
        beams.new_constrained_beams, beams.beam_choices = {}, []
        entries = step.decode_entries + step.prefill_entries
        self.waiting.charge_step(step.decodes + step.prefills, entries)
        return ScheduledStep(output, entries, victims + preempted)

    def _admits(self) -> bool:
        """Whether the step being scheduled admits waiting requests: at once when nothing
        runs, else every prefill_interval steps."""
        since = self._steps_since_admission + 1  # this step counted
        return not self.running or since >= self.config.prefill_interval

    def _preempt_to_admit(self, budget: int) -> list[SequenceGroup]:
        """While the request the policy admits next (`waiting.peek()`) would find no seat
        or no blocks for its first chunk, preempts the running request the policy names for
        it (`RequestQueue.admission_victim`); returns those preempted."""
        candidate = self.waiting.peek()
        seqs = candidate.unfinished_seqs
        num_seats = max(len(seqs), candidate.num_sequences)
        num_blocks = len(seqs) * self.block_manager.num_blocks_for_tokens(
            min(len(seqs[0].token_ids), budget)
        )
        victims: list[SequenceGroup] = []
        while (
            self.num_running_seqs + num_seats > self.config.max_num_seqs
            or num_blocks > self.block_manager.num_free_blocks
        ):
            victim = self.waiting.admission_victim(
                candidate, self.running, self.config.max_num_seqs
            )
            if victim is None:
                break
            self._preempt(victim)
            victims.append(victim)
        return victims

    def requests_per_adapter(self, groups: Iterable[SequenceGroup]) -> dict[int, int]:
        """How many of `groups` run with each LoRA adapter (empty until one ever came)."""
        if not self._saw_adapters:
            return {}
        return dict(Counter(group.lora_int_id for group in groups if group.lora_int_id))

    def _running_adapters(self) -> set[int]:
        """The LoRA adapters of the running requests (at most max_loras)."""
        return {group.lora_int_id for group in self.running if group.lora_int_id}

    def _lora_int_ids(self, seq_ids: set[int]) -> dict[int, int]:
        """The adapter of each sequence of `seq_ids` that runs with one."""
        return {
            seq.seq_id: group.lora_int_id
            for group in self.running
            if group.lora_int_id
            for seq in group.seqs
            if seq.seq_id in seq_ids
        }

    def _take_cached_prefix(self, group: SequenceGroup, seqs: list[Sequence]) -> int | None:
        """Gives a sequence about to be admitted the cached blocks of its longest prefix and
        advances it past them; returns the tokens it skips, or None when it does not look up:
        without prefix caching, for a group of several sequences or with something computed
        (a preempted group of several samples or beams is recomputed as a whole), and never
        for one that asks for prompt logprobs (cached positions have no logits: the whole
        prompt is computed to score it, as in vLLM)."""
        bm = self.block_manager
        if (
            not bm.enable_prefix_caching
            or len(seqs) != 1
            or seqs[0].num_computed_tokens
            or group.wants_prompt_logprobs
        ):
            return None
        seq = seqs[0]
        blocks = bm.cached_prefix(seq)
        if blocks:
            bm.take_prefix(seq, blocks)
            seq.num_computed_tokens = len(blocks) * bm.block_size
        return seq.num_computed_tokens

    def _sample_row(self, group: SequenceGroup, seq: Sequence) -> SampleRow:
        """The row of `seq` (of a sampling request), sampled from itself: built, and
        announced to the worker (`NewSampledSequence`), the first time it is sampled; reused
        by every step after until it finishes, so a steady decode allocates no entry."""
        row = self._sample_rows.get(seq.seq_id)
        if row is None:
            row = self._sample_rows[seq.seq_id] = (seq.seq_id,), (group, seq, (seq,))
            self._new_sampled.append(
                NewSampledSequence(
                    seq.seq_id, group.sampling, group.prompt_token_ids, seq.index,
                    list(group.stop_token_ids), group.grammar, group.bad_words_token_ids,
                )
            )  # fmt: skip
        return row

    def _schedule_group(self, group: SequenceGroup, budget: int, step: _StepBuilder) -> int | None:
        """Schedules `group`'s tokens of this step by the one rule and advances its sequences
        past them; returns the number of tokens, or None, having changed nothing, when the
        free blocks are too few for all of them.

        The one rule, for prompts and decodes alike: each unfinished sequence, in order,
        computes the tokens it still needs (`num_uncomputed_tokens`: the rest of its prompt,
        all its tokens again after a preemption, or the one it sampled last), capped by what
        is left of `budget`. A sequence whose pending tokens already bring it to max_tokens
        or max_model_len computes none: it finishes on them, and past max_model_len the model
        has no positions. Live beams are planned together (`BeamSearch.plan`).

        What a scheduled sequence's last position feeds: nothing (a chunk short of its end),
        beam search (`beam_top_k`), or sampling, from the sequence itself (its cached row,
        `_sample_row`) or, for an n > 1 prompt, from it and the samples forked off it here.
        Each sequence sampled from gets a pending token."""
        beam = group.beam
        if beam is not None and group.num_unfinished_seqs > 1:
            plan = BeamSearch.plan(group, budget)
        else:
            plan = []
            for seq in group.seqs:
                if seq.is_finished:
                    continue
                pending = seq.num_pending_tokens
                known = len(seq.token_ids) + pending
                if pending and known >= group.max_num_tokens:
                    continue
                drafts = seq.spec_token_ids
                if drafts and seq.num_computed_tokens != known - 1:
                    drafts.clear()  # recomputed after a preemption: no draft this step
                num_new = known + len(drafts) - seq.num_computed_tokens
                if num_new > budget:
                    num_new = budget
                    del drafts[max(num_new - 1, 0) :]  # the budget cuts the draft first
                if num_new == 0:
                    break
                plan.append((seq, num_new))
                budget -= num_new
        if len(plan) == 1:  # most groups: one sequence
            if not self.block_manager.allocate_slots(*plan[0]):
                return None
        elif not self._allocate(plan):
            return None

        scheduled = 0
        for seq, num_new in plan:
            start = seq.num_computed_tokens
            end = start + num_new
            scheduled += num_new
            beam_top_k = 0
            shares_prompt = False
            input_token_ids = seq.token_ids[start:end]
            num_drafts = len(seq.spec_token_ids)
            if num_drafts:  # a sampled sequence's last token, then its draft
                input_token_ids += seq.spec_token_ids
                step.num_draft_tokens += num_drafts
            row: SampleRow
            if end < len(seq.token_ids) + seq.num_pending_tokens:
                # A chunk short of the sequence's end: nothing is sampled from it.
                row = (), (group, seq, ())
                shares_prompt = beam is not None and end == len(group.prompt_token_ids)
            elif beam is not None:
                row = (), (group, seq, ())
                beam_top_k = beam.candidates_needed
                if group.beam_grammar is not None:
                    self.beam_search.announce(seq, group.beam_grammar)
            elif len(group.seqs) < group.num_sequences:  # group.needs_fork, inline
                self._sample_row(group, seq)
                children = self._fork(group, seq)
                for child in children:  # the prompt this step completes is theirs too
                    child.num_computed_tokens = end
                    self._sample_row(group, child)
                sampled = (seq, *children)
                row = tuple(s.seq_id for s in sampled), (group, seq, sampled)
            else:
                row = self._sample_rows.get(seq.seq_id) or self._sample_row(group, seq)
            sample_ids, entry = row
            seq.num_computed_tokens = end
            for sampled_seq in entry[2]:  # the sequences sampled from it
                sampled_seq.num_pending_tokens += 1
            span = None
            if group.wants_prompt_logprobs:
                span = self._prompt_logprobs_span(group, start, num_new)
            item = (
                seq.seq_id, start, num_new, input_token_ids, sample_ids, beam_top_k, span,
                num_drafts,
            )  # fmt: skip
            if num_new == 1 or num_drafts:  # a draft is verified as decodes (input_batch)
                step.decodes.append(item)
                step.decode_entries.append(entry)
            else:
                step.prefills.append(item)
                step.prefill_entries.append(entry)
            if shares_prompt:
                self.beam_search.share_prompt(group, seq)
        return scheduled

    def _allocate(self, plan: list[tuple[Sequence, int]]) -> bool:
        """Allocates the slots of every planned sequence, or of none (False). The check may
        count a copy-on-write that an earlier sequence's own copy makes unneeded: it errs
        toward not fitting."""
        bm = self.block_manager
        if sum(bm.num_new_blocks_needed(s, n) for s, n in plan) > bm.num_free_blocks:
            return False
        for seq, num_new in plan:
            bm.allocate_slots(seq, num_new)
        return True

    def _preempt_for(
        self, index: int, budget: int, step: _StepBuilder, preempted: list[SequenceGroup]
    ) -> int | None:
        """Preempts running groups not yet scheduled this step (`running[index:]`), the one
        the policy names first (`RequestQueue.preemption_victim`: under fcfs the most
        recently admitted), until `running[index]` is scheduled; returns its tokens, or None
        when it had to go itself."""
        group = self.running[index]
        while True:
            victim = self.waiting.preemption_victim(self.running[index:])
            self._preempt(victim)
            preempted.append(victim)
            if victim is group:
                return None
            scheduled = self._schedule_group(group, budget, step)
            if scheduled is not None:
                return scheduled

    def _prompt_logprobs_span(
        self, group: SequenceGroup, start: int, num_new: int
    ) -> PromptLogprobsSpan | None:
        """The positions of a chunk [start, start + num_new) that score prompt tokens the
        request has not had log-probabilities for (position p scores token p + 1; the last
        prompt position scores the first output token instead)."""
        num_top = group.sampling.prompt_logprobs
        assert num_top is not None, "only a request that asks for prompt logprobs has spans"
        first = max(start, group.prompt_logprobs_next)
        end = min(start + num_new, len(group.prompt_token_ids) - 1)
        if end <= first:
            return None
        group.prompt_logprobs_next = end
        self._num_prompt_logprobs_spans += 1
        targets = group.prompt_token_ids[first + 1 : end + 1]
        return PromptLogprobsSpan(first, end, num_top, targets)

    def _fork(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        self._num_running_seqs = None
        children = []
        while group.needs_fork:
            child = parent.fork(self.new_seq_id(), len(group.seqs))
            self.block_manager.fork(parent, child)
            group.seqs.append(child)
            children.append(child)
        return children

    def _preempt(self, group: SequenceGroup) -> None:
        """Takes a running group back to the waiting queue (`RequestQueue.prepend`), its blocks
        freed and its tokens kept (preemption by recompute)."""
        self.running.remove(group)
        self._num_running_seqs = None
        for seq in group.unfinished_seqs:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.prepend(group)

    # -- results -----------------------------------------------------------------------------

    def update(self, step: ScheduledStep, result: ModelRunnerOutput) -> SchedulerUpdate:
        """Applies a step's results (`StepUpdater.update`), then drops the finished groups
        from their queue."""
        update = self.updater.update(step, result)
        if result.beam_seq_ids:
            self._num_running_seqs = None  # a first step turns one sequence into beams
        if update.finished:
            for group in update.finished:
                self.users.ended(group)
            was_running = {id(g) for g in self.running}
            self.running = [g for g in self.running if not g.is_finished]
            # A group that finished here without running was preempted after this step was
            # scheduled (a late token finished it): only then can a finished group be
            # waiting. Looking among the finished, not the waiting, keeps a step's cost
            # independent of how many requests wait.
            if any(id(g) not in was_running for g in update.finished):
                self.waiting.remove_finished()
        return update

    def _forget(self, seq_ids: list[int]) -> None:
        """Has the worker drop these sequences' state with the next step (beams a search
        dropped)."""
        self._finished_seq_ids += seq_ids

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Ends a sampled sequence (a stop rule, an abort, a failure): frees its blocks,
        tells the worker to forget it and has the running count recounted (every way a
        sequence ends comes here)."""
        self._num_running_seqs = None
        seq.status = status
        self.block_manager.free(seq)
        kept = self._sample_rows.pop(seq.seq_id, None) is not None
        if kept or self.beam_search.forget(seq.seq_id):
            self._finished_seq_ids.append(seq.seq_id)
