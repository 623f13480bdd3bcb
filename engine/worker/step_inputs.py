"""One forward's inputs on the host, built from each sequence's context and query lengths
and block-table row (the runner's steps, the draft model's and the memory profile's), and
the one way a host array reaches the device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from octavo.engine.worker.attention.backend import AttentionMetadata


@dataclass
class StepInputs:
    """A forward's token layout, sequences in order (those with one query token first).

    Token arrays ([T]): input_ids, positions, slot_mapping. Sequence arrays ([S]): seq_lens
    (tokens in the cache after the forward), query_lens; cu_seqlens_q [S + 1]; block_tables
    [S, blocks the longest sequence needs] (entries past a sequence's seq_len hold stale or
    null ids: kernels never read them). num_decodes: the leading sequences with one query
    token. decodes_share_sequences: several of those decodes are positions of one sequence
    (a draft verified position by position).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    query_lens: np.ndarray
    cu_seqlens_q: np.ndarray
    block_tables: np.ndarray
    num_decodes: int
    decodes_share_sequences: bool

    @classmethod
    def build(
        cls,
        input_ids: np.ndarray,
        context_lens: np.ndarray,
        query_lens: np.ndarray,
        table: np.ndarray,
        rows: np.ndarray,
        block_size: int,
    ) -> StepInputs:
        """The inputs of sequences whose query_lens [S] tokens (input_ids, in order) follow
        their context_lens [S] cached ones, sequence k's blocks being table[rows[k]]."""
        positions, slot_mapping, seq_lens, cu_seqlens_q, block_tables, num_decodes = token_layout(
            context_lens, query_lens, table, rows, block_size
        )
        return cls(
            input_ids, positions, slot_mapping, seq_lens, query_lens, cu_seqlens_q,
            block_tables, num_decodes, decodes_share_sequences=False,
        )  # fmt: skip

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def attention_metadata(self, device: torch.device, block_size: int) -> AttentionMetadata:
        """The layout as the attention backends take it, its arrays on `device`."""
        return AttentionMetadata(
            slot_mapping=on_device(self.slot_mapping, device),
            block_tables=on_device(self.block_tables, device),
            seq_lens=on_device(self.seq_lens, device),
            cu_seqlens_q=on_device(self.cu_seqlens_q, device),
            max_seqlen_q=int(self.query_lens.max()),
            max_seqlen_k=int(self.seq_lens.max()),
            block_size=block_size,
            seq_lens_host=self.seq_lens.tolist(),
            query_lens_host=self.query_lens.tolist(),
            num_decodes=self.num_decodes,
            decodes_share_sequences=self.decodes_share_sequences,
        )


def token_layout(
    context_lens: np.ndarray,
    query_lens: np.ndarray,
    table: np.ndarray,
    rows: np.ndarray,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Each token's position and cache slot for sequences whose query_lens [S] tokens follow
    their context_lens [S] cached ones, sequence k's blocks being table[rows[k]]; returns
    (positions, slot_mapping, seq_lens, cu_seqlens_q, block_tables, num_decodes), as
    StepInputs holds them (num_decodes: how many sequences lead with one query token each).
    block_size is a power of two."""
    num_seqs = len(query_lens)
    seq_lens = context_lens + query_lens
    cu_seqlens_q = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(query_lens, out=cu_seqlens_q[1:])
    num_tokens = int(cu_seqlens_q[-1])
    if num_tokens == num_seqs:  # decodes only: a token per sequence
        positions = context_lens.astype(np.int64)
        token_rows = rows
        num_decodes = num_seqs
    else:
        num_decodes = int(np.argmax(query_lens != 1))
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        offsets = np.arange(num_tokens) - cu_seqlens_q[:-1][seq_of_token]
        positions = context_lens[seq_of_token].astype(np.int64) + offsets
        token_rows = rows[seq_of_token]
    # Shifts and masks, not (slow) int64 division.
    shift = block_size.bit_length() - 1
    blocks = table[token_rows, positions >> shift].astype(np.int64)
    slot_mapping = (blocks << shift) | (positions & (block_size - 1))
    width = -(-int(seq_lens.max()) // block_size) if num_seqs else 0
    return positions, slot_mapping, seq_lens, cu_seqlens_q, table[rows, :width], num_decodes


def on_device(
    values: list | np.ndarray, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`values` as a tensor on `device` (on CPU, numpy's memory shared). On CUDA through
    pinned memory and a non-blocking copy: `torch.tensor(values, device=cuda)` copies and
    then waits for the stream, that is for the step in flight (torch's pinned-memory cache
    frees the buffer only after its copy has run)."""
    if isinstance(values, np.ndarray):  # from_numpy: several times cheaper than as_tensor
        host = torch.from_numpy(np.ascontiguousarray(values))
        host = host if dtype is None else host.to(dtype)
    else:
        host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    # `torch.tensor(ndarray, pin_memory=True)` is refused, so numpy rows are pinned by copy.
    return host.pin_memory().to(device, non_blocking=True)
