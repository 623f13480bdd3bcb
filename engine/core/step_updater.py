"""Applying a step's results to its requests: each sampled token appended and stop-checked,
drafts verified, beam searches advanced, prompt logprobs attached; what each request gained
comes back as outputs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from octavo.engine.core.beam_search import BeamSearch
from octavo.engine.core.request_outputs import (
    attach_prompt_logprobs,
    final_output,
    progress_output,
)
from octavo.engine.core.scheduled_step import ScheduledStep
from octavo.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from octavo.engine.core.stop_checker import StopChecker
from octavo.engine.core_messages import EngineCoreOutput, PromptLogprobs, SampleDelta
from octavo.engine.step_io import ModelRunnerOutput

logger = logging.getLogger(__name__)


@dataclass
class SchedulerUpdate:
    """What a step's results did to the requests. `outputs`: one per request that progressed
    or ended in the step (`request_outputs`; a `final_only` request's samples say nothing
    until they finish, then all their tokens at once), with its prompt logprobs of the step.
    `finished`: the requests that ended (a stop rule, a failure -- `group.error` -- or a beam
    search's end)."""

    outputs: list[EngineCoreOutput]
    finished: list[SequenceGroup]


class StepUpdater:
    """The scheduler's results half: `update` applies one step's results and keeps the
    counts of tokens generated and drafts verified.

    `finish(seq, status)` is the scheduler's one way a sequence ends (blocks freed, the
    worker told); `forget(seq_ids)` hands it beams the worker should drop. Whatever raises
    while one group is updated (sampling bookkeeping, stop checks, beam arithmetic) fails
    that group alone; the others are updated as usual.
    """

    def __init__(
        self,
        stop_checker: StopChecker,
        beam_search: BeamSearch,
        finish: Callable[[Sequence, SequenceStatus], None],
        forget: Callable[[list[int]], None],
    ):
        self.stop_checker = stop_checker
        self.beam_search = beam_search
        self._finish = finish
        self._forget = forget
        self.num_generation_tokens = 0  # tokens sampled
        self.num_draft_tokens = 0  # speculative decoding: draft tokens verified
        self.num_accepted_tokens = 0  # of which the model chose
        # Per draft position (0: the first draft token), how often the model chose it.
        self.num_accepted_tokens_per_pos: list[int] = []

    def update(self, step: ScheduledStep, result: ModelRunnerOutput) -> SchedulerUpdate:
        """Applies a step's results in three jobs: the sampled rows (tokens appended, stop
        rules, `_update_sampled`), the beam searches (`_update_beams`) and the prompt
        logprobs (`_attach_prompt_logprobs`). Says what each request gained (see
        `SchedulerUpdate`)."""
        now = time.monotonic()
        update = SchedulerUpdate([], [])
        self._update_sampled(step, result, update, now)
        if result.beam_seq_ids:
            self._update_beams(step, result, update, now)
        if result.prompt_logprobs:
            self._attach_prompt_logprobs(step, result, update)
        return update

    def _update_sampled(
        self, step: ScheduledStep, result: ModelRunnerOutput, update: SchedulerUpdate, now: float
    ) -> None:
        """Appends each sampled row's token to its sequence and applies the stop rules.

        Rows come in the order of the step's scheduled sequences and their samples; each row
        names its sequence and a row that names another is a broken contract
        (AssertionError). A sequence that computed a draft has a row per draft position
        (`_keep_drafted`). One loop does everything per row: this runs for every token of
        every request."""
        seq_ids, sampled = result.sampled_seq_ids, result.sampled
        token_ids, logprobs, top_logprobs = (
            sampled.token_ids, sampled.logprobs, sampled.top_logprobs
        )  # fmt: skip
        grammar_ended, grammar_failed = result.grammar.ended, result.grammar.failed
        outputs, finished = update.outputs, update.finished
        # Groups with several samples gather their deltas here (first: their first tokens).
        gathered: dict[int, tuple[SequenceGroup, list[SampleDelta], bool]] = {}
        row = 0
        num_tokens = len(seq_ids)  # tokens kept: rows, less the drafts' rows not kept
        for group, _, sample_seqs in step.entries:
            for seq in sample_seqs:  # none for a chunk short of its sequence's end
                if seq_ids[row] != seq.seq_id:
                    raise AssertionError(f"row {row} is sequence {seq_ids[row]}, not {seq.seq_id}")
                drafts = seq.spec_token_ids
                token_id, logprob, top = token_ids[row], logprobs[row], top_logprobs[row]
                first_row = row
                row += 1
                if drafts:  # a row per draft token besides
                    row += len(drafts)
                seq.num_pending_tokens -= 1
                if seq.is_finished:  # a token sampled past a stop, an abort or a failure
                    seq.spec_token_ids = []
                    continue
                first = group.first_token_time is None
                if first:
                    group.first_token_time = now
                try:
                    if drafts:
                        new_token_ids, tops, finish_reason = self._keep_drafted(
                            group, seq, first_row, result
                        )
                        num_tokens += len(new_token_ids) - 1 - len(drafts)
                    else:
                        tokens = seq.token_ids
                        tokens.append(token_id)
                        if grammar_failed and seq.seq_id in grammar_failed:
                            raise ValueError(
                                f"structured outputs: no token the grammar allows was left "
                                f"(token {token_id}: {grammar_failed[seq.seq_id]})"
                            )
                        if logprob is not None:
                            seq.cumulative_logprob += logprob
                        finish_reason = None
                        ended = bool(grammar_ended) and seq.seq_id in grammar_ended
                        if (
                            ended
                            or token_id in group.stop_token_ids
                            or len(tokens) >= group.max_num_tokens
                        ):
                            finish_reason = self._stop(seq, group, ended)
                        new_token_ids = [token_id]
                        tops = None if top is None else [top]
                except Exception as exc:  # noqa: BLE001 -- one request's fault is its own
                    self._fail(group, exc)
                    finished.append(group)
                    outputs.append(final_output(group, []))
                    gathered.pop(id(group), None)
                    continue  # its other rows still count (their sequences are finished)
                if group.final_only:  # a sample's finish carries all its tokens, nothing else
                    if finish_reason is None:
                        continue
                    new_token_ids = seq.output_token_ids
                delta = SampleDelta(
                    seq.index, new_token_ids, None if logprob is None else seq.cumulative_logprob,
                    tops, finish_reason, seq.stop_reason,
                )  # fmt: skip
                if len(group.seqs) == 1:  # one sample: its output is complete
                    if finish_reason is not None:
                        finished.append(group)
                        outputs.append(final_output(group, [delta]))
                    else:
                        outputs.append(progress_output(group, [delta], first))
                    continue
                gathering = gathered.get(id(group))
                if gathering is None:
                    gathering = gathered[id(group)] = (group, [], first)
                gathering[1].append(delta)
        if row != len(seq_ids):
            raise AssertionError(f"{len(seq_ids)} rows for {row} sampled sequences")
        self.num_generation_tokens += num_tokens
        for group, deltas, first in gathered.values():
            if group.is_finished:
                finished.append(group)
                outputs.append(final_output(group, deltas))
            else:
                outputs.append(progress_output(group, deltas, first))

    def _keep_drafted(
        self, group: SequenceGroup, seq: Sequence, row: int, result: ModelRunnerOutput
    ) -> tuple[list[int], list[dict[int, float]] | None, str | None]:
        """Applies the rows of a sequence that computed its draft (speculative decoding):
        row i is the model's token after the draft's first i tokens. The sequence keeps the
        rows' tokens up to the first whose draft token the model did not choose, that row's
        own token included (the first row's always: a step gains at least one token),
        stopping at a stop rule; the cache keeps the positions of the kept inputs. Returns
        the tokens kept, their top logprobs (None when not asked for) and the finish
        reason."""
        sampled = result.sampled
        drafts = seq.spec_token_ids
        seq.spec_token_ids = []
        count = len(drafts) + 1
        if result.sampled_seq_ids[row : row + count] != [seq.seq_id] * count:
            raise AssertionError(f"rows {row}..{row + count - 1} are not sequence {seq.seq_id}")
        chosen = sampled.token_ids[row : row + count]
        accepted = 0
        while accepted < len(drafts) and chosen[accepted] == drafts[accepted]:
            accepted += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos += [0] * (accepted - len(per_pos))  # nothing when it is long enough
        for position in range(accepted):
            per_pos[position] += 1
        new_token_ids: list[int] = []
        tops: list[dict[int, float]] = []
        finish_reason = None
        for r in range(row, row + accepted + 1):
            token_id, logprob = sampled.token_ids[r], sampled.logprobs[r]
            seq.token_ids.append(token_id)
            new_token_ids.append(token_id)
            top = sampled.top_logprobs[r]
            if top is not None:
                tops.append(top)
            if logprob is not None:
                seq.cumulative_logprob += logprob
            if token_id in group.stop_token_ids or len(seq.token_ids) >= group.max_num_tokens:
                finish_reason = self._stop(seq, group, False)
                if finish_reason is not None:
                    break
        seq.num_computed_tokens = len(seq.token_ids) - 1  # its last token's K/V: next step
        return new_token_ids, tops or None, finish_reason

    def _update_beams(
        self, step: ScheduledStep, result: ModelRunnerOutput, update: SchedulerUpdate, now: float
    ) -> None:
        """Advances each beam search the step computed candidates for (a group's beams are
        scheduled together: one `BeamSearch.step` each)."""
        rows = {seq_id: row for row, seq_id in enumerate(result.beam_seq_ids)}
        groups = {
            id(group): group
            for item, (group, _, _) in zip(step.output.scheduled, step.entries, strict=True)
            if item.beam_top_k
        }
        for group in groups.values():
            if group.is_finished:
                continue
            beams = group.unfinished_seqs
            try:
                assert result.beam_candidates is not None, "beam rows without candidates"
                candidates = result.beam_candidates.rows([rows[b.seq_id] for b in beams])
                self.beam_search.step(group, candidates)
            except Exception as exc:  # noqa: BLE001 -- one request's fault is its own
                self._fail(group, exc)
            else:
                if group.beam_grammar is not None:
                    self._forget(self.beam_search.follow(group, beams))
                self.num_generation_tokens += len(beams)
                if group.first_token_time is None:
                    group.first_token_time = now
            if group.is_finished:
                update.finished.append(group)
                update.outputs.append(final_output(group, []))

    @staticmethod
    def _attach_prompt_logprobs(
        step: ScheduledStep, result: ModelRunnerOutput, update: SchedulerUpdate
    ) -> None:
        """Hands each request the prompt logprobs its chunk of the step scored."""
        chunks: dict[str, PromptLogprobs] = {}
        groups: dict[str, SequenceGroup] = {}
        for item, (group, _, _) in zip(step.output.scheduled, step.entries, strict=True):
            chunk = result.prompt_logprobs.get(item.seq_id)
            if chunk is not None and group.error is None:
                chunks[group.request_id], groups[group.request_id] = chunk, group
        attach_prompt_logprobs(update.outputs, chunks, groups)

    def _fail(self, group: SequenceGroup, exc: BaseException) -> None:
        """Ends a request whose processing raised: its unfinished sequences finish with
        FINISHED_ERROR and free their blocks; `group.error` says why, for its client."""
        logger.error("request %s failed", group.request_id, exc_info=exc)
        group.error = f"{type(exc).__name__}: {exc}"
        for seq in group.unfinished_seqs:
            self._finish(seq, SequenceStatus.FINISHED_ERROR)

    def _stop(self, seq: Sequence, group: SequenceGroup, grammar_ended: bool) -> str | None:
        """Applies the stop rules to the token `seq` just received (`StopChecker.check`) and
        ends it if one decides; returns its finish reason, None if no rule did."""
        status = self.stop_checker.check(seq, group, grammar_ended)
        if status is None:
            return None
        self._finish(seq, status)
        return status.finish_reason
