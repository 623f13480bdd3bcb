"""Decode steps replayed from CUDA graphs: GPT-2 small is launch-bound without them."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionMetadata
from engine.models.gpt2 import GPT2LMHeadModel
from kernels.paged_attention import choose_num_splits

# Captured batch sizes: small powers of two, then every multiple of this step.
_BUCKET_STEP = 16


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 below max_batch_size, then max_batch_size."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    buckets += range(_BUCKET_STEP, max_batch_size, _BUCKET_STEP)
    return [*buckets, max_batch_size]


class CUDAGraphRunner:
    """Captures one decode step (forward + logits of every row) per batch-size bucket.

    All inputs live in static device buffers; a step copies its values in and replays the
    smallest bucket that fits. Padding rows store nothing (slot -1) and attend to one key of
    the zeroed null block (seq_len 1, block table row of zeros). The split-KV factor of each
    bucket is fixed at capture for max_model_len; shorter contexts leave splits empty.
    """

    def __init__(
        self,
        model: GPT2LMHeadModel,
        kv_cache: torch.Tensor,
        max_batch_size: int,
        max_model_len: int,
        block_size: int,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.buckets = batch_size_buckets(max_batch_size)
        device = kv_cache.device
        largest = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((largest, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,
            block_size=self.block_size,
            seq_lens_host=[],
            query_lens_host=[],
            decode_num_splits=choose_num_splits(
                size, self.model.config.n_head, self.max_model_len, self.num_sms
            ),
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(
            self.input_ids[:size], self.positions[:size], self.kv_cache, self._metadata(size)
        )
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first, all sharing one memory pool."""
        pool = None
        for size in reversed(self.buckets):
            self._forward(size)  # compile and warm up outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        seq_lens: list[int],
    ) -> torch.Tensor:
        """Logits [len(input_ids), vocab] of a decode-only batch (one token per sequence)."""
        n = len(input_ids)
        size = next(b for b in self.buckets if b >= n)
        width = max(len(t) for t in tables)
        host = torch.zeros((n, width), dtype=torch.int32)
        for row, table in enumerate(tables):
            host[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        self.input_ids[:n].copy_(torch.tensor(input_ids), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.tensor(slots), non_blocking=True)
        self.seq_lens[:n].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[:n, :width].copy_(host, non_blocking=True)
        # Padding rows: no store, one key from the null block.
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)
        self.block_tables[n:size, 0].zero_()
        self.graphs[size].replay()
        return self.logits[size][:n]
