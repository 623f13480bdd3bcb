"""The model runner's persistent batch: per-sequence block-table rows kept across steps, and
one step's inputs computed from them with array operations."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from octavo.engine.step_io import SamplingRequest, SchedulerOutput


@dataclass
class HostBatch:
    """One step's model inputs on the host, sequences in scheduled order (decodes first).

    Token arrays ([T]): input_ids, positions, slot_mapping. Sequence arrays ([S]): seq_lens
    (tokens in the cache after the step), query_lens; cu_seqlens_q [S + 1]; block_tables
    [S, max blocks of the step] (unused entries hold stale or null ids: kernels never read
    past seq_len). `logits_rows` are the token indices whose logits are needed: first one per
    sampling row (`requests`, `sampled_seq_ids`), then one per beam row (`beam_seq_ids`).
    `pending_rows` are the token indices whose input token the host does not know yet (async
    scheduling: sampled by the previous step, of sequences `pending_seq_ids`); input_ids holds
    0 there until the runner fills them in on the device.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    query_lens: np.ndarray
    cu_seqlens_q: np.ndarray
    block_tables: np.ndarray
    logits_rows: np.ndarray
    requests: list[SamplingRequest]
    sampled_seq_ids: list[int]
    beam_seq_ids: list[int]
    beam_top_k: int  # candidates per beam row: the most any beam group of the step needs
    num_decodes: int  # leading sequences with one query token
    pending_rows: np.ndarray
    pending_seq_ids: list[int]
    prompt_logprobs: list[PromptLogprobsRows] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_graph_decode(self) -> bool:
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
    """Block-table rows of the live sequences, in a preallocated int32 array.

    A sequence gets a row the first time it is scheduled and keeps it until the scheduler
    reports it freed; its row is rewritten only when the scheduler reports its table changed
    (new, grown into a new block, copy-on-write, forked). A steady decode inside its last block
    costs one dictionary lookup here; positions, slots and lengths are computed with array
    operations over the whole step.
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int):
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        # One row per running sequence; doubled if ever full (a step's freed rows are
        # returned before its new ones are taken, so max_num_seqs rows normally suffice).
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        self._row_of: dict[int, int] = {}
        self._free_rows = list(range(len(self.block_table) - 1, -1, -1))
        self._stale: set[int] = set()  # changed tables not yet rewritten into their rows

    @property
    def num_rows_in_use(self) -> int:
        return len(self._row_of)

    def _add(self, seq_id: int) -> int:
        if not self._free_rows:
            old = len(self.block_table)
            self.block_table = np.concatenate((self.block_table, np.zeros_like(self.block_table)))
            self._free_rows = list(range(len(self.block_table) - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        return row

    def _drop(self, seq_id: int) -> None:
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)
        self._stale.discard(seq_id)

    def prepare(self, output: SchedulerOutput) -> HostBatch:
        """Applies the step's row changes and computes its inputs.

        Each per-sequence field is read in one comprehension over the step (several short
        passes cost less in Python than one loop of appends); the rest is array arithmetic.
        """
        for seq_id in output.freed_seq_ids:
            self._drop(seq_id)
        scheduled = output.scheduled
        stale = self._stale
        stale |= output.changed_seq_ids
        if stale:  # a sequence without a row is always among the changed ones
            for item in [item for item in scheduled if item.seq_id in stale]:
                row = self._row_of.get(item.seq_id)
                if row is None:
                    row = self._add(item.seq_id)
                blocks = item.block_table
                self.block_table[row, : len(blocks)] = blocks
                stale.discard(item.seq_id)
        table, row_of = self.block_table, self._row_of
        num_seqs = len(scheduled)
        rows = np.array([row_of[item.seq_id] for item in scheduled], dtype=np.int64)
        query_lens = np.array([item.num_new_tokens for item in scheduled], dtype=np.int32)
        context_lens = np.array([item.start for item in scheduled], dtype=np.int32)
        seq_lens = context_lens + query_lens
        cu_seqlens_q = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu_seqlens_q[1:])
        num_tokens = int(cu_seqlens_q[-1])
        num_decodes = num_seqs  # the leading run of one-token sequences
        if num_tokens != num_seqs:
            num_decodes = int(np.argmax(query_lens != 1))
        # A decode's input token, or PENDING when the previous step sampled it and it is
        # still on the device; every other sequence's chunk of tokens.
        input_ids = np.array(
            [
                item.token_ids[item.start] if item.start < len(item.token_ids) else _PENDING
                for item in scheduled[:num_decodes]
            ] + [
                token
                for item in scheduled[num_decodes:]
                for token in item.token_ids[item.start : item.start + item.num_new_tokens]
            ],
            dtype=np.int64,
        )  # fmt: skip
        pending_rows = np.flatnonzero(input_ids[:num_decodes] == _PENDING)
        if len(pending_rows):
            input_ids[pending_rows] = 0  # the runner fills them in on the device
        if num_tokens == num_seqs:  # decodes only: a token per sequence
            positions = context_lens.astype(np.int64)
            token_rows = rows
        else:
            seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
            offsets = np.arange(num_tokens) - cu_seqlens_q[:-1][seq_of_token]
            positions = context_lens[seq_of_token].astype(np.int64) + offsets
            token_rows = rows[seq_of_token]
        # block_size is a power of two: shifts and masks, not (slow) int64 division.
        bs = self.block_size
        shift = bs.bit_length() - 1
        blocks = table[token_rows, positions >> shift].astype(np.int64)
        slot_mapping = (blocks << shift) | (positions & (bs - 1))
        width = -(-int(seq_lens.max()) // bs) if num_seqs else 0

        # Logits rows: each sequence's last token, once per sample it feeds, then once per
        # beam row.
        requests = [request for item in scheduled for request in item.samples]
        last_token = cu_seqlens_q[1:].astype(np.int64) - 1
        if len(requests) == num_seqs and num_tokens == num_seqs:
            logits_rows = last_token  # the steady state: every decode samples once
        else:
            samples_per_seq = [len(item.samples) for item in scheduled]
            logits_rows = np.repeat(last_token, samples_per_seq)
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
            block_tables=table[rows, :width],
            logits_rows=logits_rows,
            requests=requests,
            sampled_seq_ids=[request.seq.seq_id for request in requests],
            beam_seq_ids=[scheduled[k].seq_id for k in beam_seqs],
            beam_top_k=max((scheduled[k].beam_top_k for k in beam_seqs), default=0),
            num_decodes=num_decodes,
            pending_rows=pending_rows.astype(np.int64),
            pending_seq_ids=[scheduled[k].seq_id for k in pending_rows.tolist()],
            prompt_logprobs=self._prompt_logprobs(output, cu_seqlens_q),
        )

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
            targets = np.array(item.token_ids[span.start + 1 : span.end + 1], dtype=np.int64)
            found.append(PromptLogprobsRows(item.seq_id, rows, targets, span.num_top))
        return found
