"""The model runner's persistent batch: per-sequence state kept across steps (block-table
rows, sampling state), and one step's inputs computed from it with array operations."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from llguidance import LLMatcher

from octavo.engine.step_io import GrammarProgress, ScheduledSequence, SchedulerOutput
from octavo.engine.worker.grammar import GrammarMatchers
from octavo.engine.worker.penalties import PenaltyCounts
from octavo.engine.worker.sampling_batch import SamplingBatch, SamplingColumns
from octavo.engine.worker.sampling_state import SamplingState
from octavo.engine.worker.step_inputs import StepInputs, token_layout


@dataclass(kw_only=True)
class HostBatch(StepInputs):
    """One step's model inputs on the host (StepInputs: sequences in scheduled order, decodes
    first) and what the runner does with its hidden states.

    `logits_rows` are the token indices whose logits are needed: first one per sampling row
    (`sampling`, `sampled_seq_ids`), then one per beam row (`beam_seq_ids`). `pending_rows`
    are the token indices whose input token the host does not know yet (async scheduling:
    sampled by the previous step, of sequences `pending_seq_ids`); input_ids holds 0 there
    until the runner fills them in on the device.
    """

    logits_rows: np.ndarray
    sampling: SamplingBatch
    sampled_seq_ids: list[int]
    beam_seq_ids: list[int]
    beam_top_k: int  # candidates per beam row: the most any beam group of the step needs
    pending_rows: np.ndarray
    pending_seq_ids: list[int]
    prompt_logprobs: list[PromptLogprobsRows] = field(default_factory=list)
    # Each token's LoRA adapter (0: the base); None when no sequence has one.
    token_lora_ids: np.ndarray | None = None

    @property
    def is_uniform_decode(self) -> bool:
        """Every sequence decodes one token and its logits row is its own, in order (and no
        prompt logprobs want other rows): the shape a captured decode graph computes."""
        num_seqs = self.num_seqs
        return (
            not self.prompt_logprobs
            and self.num_decodes == num_seqs
            and len(self.logits_rows) == num_seqs
            and bool((self.logits_rows == np.arange(num_seqs)).all())
        )


@dataclass
class PromptLogprobsRows:
    """Token indices `rows` of a step whose logits score the prompt tokens `targets` of
    sequence `seq_id`, each with the `num_top` most likely tokens."""

    seq_id: int
    rows: np.ndarray
    targets: np.ndarray
    num_top: int


@dataclass
class PendingInputs:
    """Input tokens the host does not know yet: token indices `rows` of this step take
    `tokens` (both on the device), sampled by the previous step."""

    rows: torch.Tensor
    tokens: torch.Tensor


_PENDING = -1  # an input token id no vocabulary has: the token is still on the device


class InputBatch:
    """The worker's state of the live sequences: block-table rows in a preallocated int32
    array, and a `SamplingState` per sequence it samples for.

    A sequence gets a row when the scheduler first sends its table and keeps it until the
    scheduler reports it freed; its row is rewritten only when the scheduler sends its table
    again (grown into a new block, copy-on-write, forked). A steady decode inside its last
    block costs one dictionary lookup here; positions, slots and lengths are computed with
    array operations over the whole step.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        grammars: GrammarMatchers,
    ):
        self.block_size = block_size
        self.device = device
        self.grammars = grammars
        self.sampling: dict[int, SamplingState] = {}
        self.sampling_columns = SamplingColumns(max_num_seqs, PenaltyCounts(vocab_size, device))
        self._keeping_outputs: set[int] = set()  # sequences whose sampling reads its outputs
        self._constrained: set[int] = set()  # sampled sequences with a grammar
        # The grammar state of each beam of a constrained beam search.
        self.beam_matchers: dict[int, LLMatcher] = {}
        max_blocks = -(-max_model_len // block_size)
        # One row per running sequence; doubled if ever full (a step's freed rows are
        # returned before its new ones are taken, so max_num_seqs rows normally suffice).
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        # Each row's LoRA adapter (0: the base); read only once some sequence had one.
        self.row_lora = np.zeros(max_num_seqs, dtype=np.int64)
        self._serves_adapters = False
        self._row_of: dict[int, int] = {}
        self._free_rows = list(range(len(self.block_table) - 1, -1, -1))

    @property
    def num_rows_in_use(self) -> int:
        return len(self._row_of)

    def _add(self, seq_id: int) -> int:
        if not self._free_rows:
            old = len(self.block_table)
            self.block_table = np.concatenate((self.block_table, np.zeros_like(self.block_table)))
            self.row_lora = np.concatenate((self.row_lora, np.zeros_like(self.row_lora)))
            self._free_rows = list(range(len(self.block_table) - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        return row

    def record_sampled(self, seq_ids: list[int], token_ids: list[int]) -> GrammarProgress:
        """Keeps the sampled tokens that reached the host, for the sequences whose sampling
        reads its outputs, and advances each constrained sequence's matcher by its token (a
        sequence finished meanwhile is gone: its token is dropped). Returns the constrained
        sequences whose grammar this ended or refused."""
        progress = GrammarProgress()
        keeping, constrained = self._keeping_outputs, self._constrained
        if not keeping and not constrained:
            return progress
        for seq_id, token_id in zip(seq_ids, token_ids, strict=True):
            if seq_id in keeping:
                self.sampling[seq_id].output_token_ids.append(token_id)
            if seq_id in constrained:
                matcher = self.sampling[seq_id].matcher
                assert matcher is not None
                if not matcher.consume_token(token_id):
                    progress.failed[seq_id] = matcher.get_error()
                elif matcher.is_stopped():
                    progress.ended.add(seq_id)
        return progress

    def apply_changes(self, output: SchedulerOutput) -> None:
        """What changed since the previous step: freed rows, the beams constrained searches
        go on with, finished sequences, new sampled sequences and new or changed block
        tables."""
        for seq_id in output.freed_seq_ids:
            row = self._row_of.pop(seq_id, None)
            if row is not None:
                self._free_rows.append(row)
        self._follow_beams(output)
        for seq_id in output.finished_seq_ids:
            self.beam_matchers.pop(seq_id, None)
            finished = self.sampling.pop(seq_id, None)
            if finished is not None:
                self.sampling_columns.remove(finished.slot)
                self._keeping_outputs.discard(seq_id)
                self._constrained.discard(seq_id)
        for new in output.new_sampled:
            state = SamplingState.create(new, self.device, self.grammars)
            self.sampling[new.seq_id] = state
            state.slot = self.sampling_columns.add(state)
            if state.keeps_outputs:
                self._keeping_outputs.add(new.seq_id)
            if state.matcher is not None:
                self._constrained.add(new.seq_id)
        lora_int_ids = output.lora_int_ids
        self._serves_adapters = self._serves_adapters or bool(lora_int_ids)
        for seq_id, blocks in output.block_tables.items():
            row = self._row_of.get(seq_id)
            if row is None:
                row = self._add(seq_id)
                self.row_lora[row] = lora_int_ids.get(seq_id, 0)
            self.block_table[row, : len(blocks)] = blocks

    def _follow_beams(self, output: SchedulerOutput) -> None:
        """Starts the grammar state of each new constrained search's first beam; gives every
        beam a search goes on with its parent's state advanced by its token (copies first,
        so that a parent that is also continued keeps the state its forks copy)."""
        for seq_id, grammar in output.new_constrained_beams.items():
            self.beam_matchers[seq_id] = self.grammars.matcher(grammar)
        if not output.beam_choices:
            return
        parents = {
            c.parent_seq_id: self.beam_matchers[c.parent_seq_id] for c in output.beam_choices
        }
        for choice in output.beam_choices:
            matcher = parents[choice.parent_seq_id].deep_copy()
            # A refused token leaves the matcher in its error state: it allows nothing, so
            # the beam's candidates are all -inf and the search drops it.
            matcher.consume_token(choice.token_id)
            self.beam_matchers[choice.seq_id] = matcher

    def prepare(self, output: SchedulerOutput) -> HostBatch:
        """Applies the step's row changes and computes its inputs.

        Each per-sequence field is read in one comprehension over the step (several short
        passes cost less in Python than one loop of appends); the rest is array arithmetic.
        """
        self.apply_changes(output)
        scheduled = output.scheduled
        if output.num_draft_tokens:
            scheduled = self._verified_positions(scheduled)
        row_of = self._row_of
        rows = np.array([row_of[item.seq_id] for item in scheduled], dtype=np.int64)
        query_lens = np.array([item.num_new_tokens for item in scheduled], dtype=np.int32)
        context_lens = np.array([item.start for item in scheduled], dtype=np.int32)
        positions, slot_mapping, seq_lens, cu_seqlens_q, block_tables, num_decodes = token_layout(
            context_lens, query_lens, self.block_table, rows, self.block_size
        )
        num_seqs, num_tokens = len(scheduled), len(positions)
        # A decode's input token, or PENDING when the previous step sampled it and it is
        # still on the device; every other sequence's chunk of tokens.
        input_ids = np.array(
            [
                item.input_token_ids[0] if item.input_token_ids else _PENDING
                for item in scheduled[:num_decodes]
            ] + [
                token for item in scheduled[num_decodes:] for token in item.input_token_ids
            ],
            dtype=np.int64,
        )  # fmt: skip
        pending_rows = np.flatnonzero(input_ids[:num_decodes] == _PENDING)
        if len(pending_rows):
            input_ids[pending_rows] = 0  # the runner fills them in on the device

        # Logits rows: each sequence's last token, once per sample it feeds, then once per
        # beam row.
        sampled_seq_ids = [seq_id for item in scheduled for seq_id in item.sample_seq_ids]
        sampling = self.sampling
        requests = [sampling[seq_id] for seq_id in sampled_seq_ids]
        last_token = cu_seqlens_q[1:].astype(np.int64) - 1
        if len(requests) == num_seqs and num_tokens == num_seqs:
            logits_rows = last_token  # the steady state: every decode samples once
        else:
            logits_rows = np.repeat(last_token, [len(item.sample_seq_ids) for item in scheduled])
        beam_seqs = [k for k, item in enumerate(scheduled) if item.beam_top_k]
        if beam_seqs:
            logits_rows = np.concatenate((logits_rows, last_token[beam_seqs]))
        return HostBatch(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            seq_lens=seq_lens,
            query_lens=query_lens,
            cu_seqlens_q=cu_seqlens_q,
            block_tables=block_tables,
            logits_rows=logits_rows,
            sampling=self.sampling_columns.gather(requests),
            sampled_seq_ids=sampled_seq_ids,
            beam_seq_ids=[scheduled[k].seq_id for k in beam_seqs],
            beam_top_k=max((scheduled[k].beam_top_k for k in beam_seqs), default=0),
            num_decodes=num_decodes,
            pending_rows=pending_rows.astype(np.int64),
            pending_seq_ids=[scheduled[k].seq_id for k in pending_rows.tolist()],
            prompt_logprobs=self._prompt_logprobs(output, cu_seqlens_q),
            token_lora_ids=(
                np.repeat(self.row_lora[rows], query_lens) if self._serves_adapters else None
            ),
            decodes_share_sequences=bool(output.num_draft_tokens),
        )

    @staticmethod
    def _verified_positions(scheduled: list[ScheduledSequence]) -> list[ScheduledSequence]:
        """The step with each sequence that carries a draft replaced by one decode per
        position it computes (its last token, then each draft token), each sampled: the
        verification runs the decode path, token for token what decoding without a draft
        would compute at those positions."""
        expanded = []
        for item in scheduled:
            if not item.num_draft_tokens:
                expanded.append(item)
                continue
            expanded += [
                ScheduledSequence(item.seq_id, item.start + offset, 1, [token], item.sample_seq_ids)
                for offset, token in enumerate(item.input_token_ids)
            ]
        return expanded

    @staticmethod
    def _prompt_logprobs(
        output: SchedulerOutput, cu_seqlens_q: np.ndarray
    ) -> list[PromptLogprobsRows]:
        if not output.has_prompt_logprobs:
            return []
        found = []
        for k, item in enumerate(output.scheduled):
            span = item.prompt_logprobs
            if span is None:
                continue
            first_row = int(cu_seqlens_q[k]) + span.start - item.start
            rows = np.arange(first_row, first_row + span.end - span.start, dtype=np.int64)
            targets = np.array(span.targets, dtype=np.int64)
            found.append(PromptLogprobsRows(item.seq_id, rows, targets, span.num_top))
        return found
