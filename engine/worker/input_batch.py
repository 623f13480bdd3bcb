"""The model runner's persistent batch: per-sequence block-table rows kept across steps, and
one step's inputs computed from them with array operations."""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_graph_decode(self) -> bool:
        """Every sequence decodes one token and its logits row is its own, in order: the
        shape a captured decode graph computes."""
        num_seqs = self.num_seqs
        return (
            self.num_decodes == num_seqs
            and len(self.logits_rows) == num_seqs
            and bool((self.logits_rows == np.arange(num_seqs)).all())
        )


@dataclass
class PendingInputs:
    """Input tokens the host does not know yet: token indices `rows` of this step take
    `tokens` (both on the device), sampled by the previous step."""

    rows: torch.Tensor
    tokens: torch.Tensor


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
        """Applies the step's row changes and computes its inputs."""
        for seq_id in output.freed_seq_ids:
            self._drop(seq_id)
        stale = self._stale
        stale |= output.changed_seq_ids
        row_of = self._row_of
        table = self.block_table
        rows: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        input_ids: list[int] = []
        logits_rows: list[int] = []
        beam_rows: list[int] = []
        requests: list[SamplingRequest] = []
        sampled_seq_ids: list[int] = []
        beam_seq_ids: list[int] = []
        pending_rows: list[int] = []
        pending_seq_ids: list[int] = []
        beam_top_k = num_decodes = num_tokens = 0
        for item in output.scheduled:
            seq_id = item.seq_id
            row = row_of.get(seq_id)
            if row is None or seq_id in stale:
                if row is None:
                    row = self._add(seq_id)
                    table = self.block_table  # _add may have grown it
                blocks = item.block_table
                table[row, : len(blocks)] = blocks
                stale.discard(seq_id)
            rows.append(row)
            start, count = item.start, item.num_new_tokens
            starts.append(start)
            counts.append(count)
            if count == 1:
                num_decodes += 1
                if start < len(item.token_ids):
                    input_ids.append(item.token_ids[start])
                else:  # the token the previous step sampled: still on the device
                    pending_rows.append(num_tokens)
                    pending_seq_ids.append(seq_id)
                    input_ids.append(0)
            else:
                input_ids.extend(item.token_ids[start : start + count])
            num_tokens += count
            for request in item.samples:
                logits_rows.append(num_tokens - 1)
                requests.append(request)
                sampled_seq_ids.append(request.seq.seq_id)
            if item.beam_top_k:
                beam_rows.append(num_tokens - 1)
                beam_seq_ids.append(seq_id)
                beam_top_k = max(beam_top_k, item.beam_top_k)

        bs = self.block_size
        rows_a = np.array(rows, dtype=np.int64)
        query_lens = np.array(counts, dtype=np.int32)
        seq_lens = np.array(starts, dtype=np.int32) + query_lens
        cu_seqlens_q = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu_seqlens_q[1:])
        if num_tokens == len(rows):  # decodes only: a token per sequence
            positions = seq_lens.astype(np.int64) - 1
            token_rows = rows_a
        else:
            seq_of_token = np.repeat(np.arange(len(rows)), query_lens)
            offsets = np.arange(num_tokens) - cu_seqlens_q[:-1][seq_of_token]
            positions = (seq_lens - query_lens)[seq_of_token].astype(np.int64) + offsets
            token_rows = rows_a[seq_of_token]
        # block_size is a power of two: shifts and masks, not (slow) int64 division.
        shift = bs.bit_length() - 1
        blocks = table[token_rows, positions >> shift].astype(np.int64)
        slot_mapping = (blocks << shift) | (positions & (bs - 1))
        width = -(-int(seq_lens.max()) // bs) if len(rows) else 0
        return HostBatch(
            input_ids=np.array(input_ids, dtype=np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            seq_lens=seq_lens,
            query_lens=query_lens,
            cu_seqlens_q=cu_seqlens_q,
            block_tables=table[rows_a, :width],
            logits_rows=np.array(logits_rows + beam_rows, dtype=np.int64),
            requests=requests,
            sampled_seq_ids=sampled_seq_ids,
            beam_seq_ids=beam_seq_ids,
            beam_top_k=beam_top_k,
            num_decodes=num_decodes,
            pending_rows=np.array(pending_rows, dtype=np.int64),
            pending_seq_ids=pending_seq_ids,
        )
