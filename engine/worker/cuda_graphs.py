"""Decode steps replayed from full CUDA graphs: GPT-2 small is launch-bound without them."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from octavo.engine.worker.attention.backend import AttentionMetadata
from octavo.engine.worker.input_batch import HostBatch, PendingInputs
from octavo.engine.worker.models.gpt2 import GPT2LMHeadModel
from octavo.kernels.paged_attention import choose_num_splits, num_sms

# Captured batch sizes: small powers of two, then every multiple of this step.
_BUCKET_STEP = 16
# What a padding row holds: no store (slot -1), one key (seq_len 1) from the null block 0.
PAD_SLOT = -1
PAD_SEQ_LEN = 1
NULL_BLOCK = 0
T = TypeVar("T")


def batch_size_buckets(max_batch_size: int, step: int = _BUCKET_STEP) -> list[int]:
    """The powers of two below `step` (a power of two; by default 1, 2, 4, 8), then every
    multiple of `step` below max_batch_size, then max_batch_size."""
    powers = [1 << i for i in range(step.bit_length() - 1) if 1 << i < max_batch_size]
    return [*powers, *range(step, max_batch_size, step), max_batch_size]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, after one collection.

    A collection during a capture can free what an earlier engine left in a reference
    cycle: its CUDA graphs or pinned buffers. Freeing those calls CUDA in ways a capturing
    stream forbids, and that invalidates the capture ("operation not permitted when stream
    is capturing"), so whether an engine starts would depend on when the collector runs.
    """
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def capture_graphs(works: Sequence[Callable[[], T]]) -> list[tuple[torch.cuda.CUDAGraph, T]]:
    """Each of `works` captured as a CUDA graph, in order, all in one memory pool, with the
    collector paused (`collector_paused`), each after one eager run outside the capture
    (Triton compiles its kernels then): the graphs and what their captured runs returned
    (their output buffers)."""
    captured = []
    pool = None  # the first graph makes one, which the others share
    with collector_paused():
        for work in works:
            work()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                captured.append((graph, work()))
            pool = graph.pool()
    torch.cuda.synchronize()
    return captured


class DecodeInputBuffers:
    """Static device buffers holding a decode batch padded to a bucket size: what a captured
    graph reads. Works on any device (the padding contract is tested on CPU).

    `load` writes a batch of n sequences and pads it to the smallest bucket b >= n; rows
    n..b store nothing (slot -1) and attend to one key of the zeroed null block (seq_len 1,
    block-table row of zeros). Block-table columns past a row's blocks may hold stale ids
    from an earlier batch: kernels never read past seq_len. The metadata of bucket b is
    fixed (max_seqlen_k = max_model_len, split-KV factor chosen for it), so one graph per
    bucket serves every context length; shorter contexts leave trailing splits empty.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_model_len: int,
        block_size: int,
        num_heads: int,
        device: torch.device,
    ):
        self.buckets = batch_size_buckets(max_batch_size)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_heads = num_heads
        self.num_sms = num_sms(device)
        largest = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        # input_ids, positions, slot_mapping: one buffer, so one host-to-device copy.
        self.tokens = torch.zeros((3, largest), dtype=torch.long, device=device)
        self.tokens[2].fill_(PAD_SLOT)
        self.seq_lens = torch.full((largest,), PAD_SEQ_LEN, dtype=torch.int32, device=device)
        self.block_tables = torch.full(
            (largest, max_blocks), NULL_BLOCK, dtype=torch.int32, device=device
        )
        self.cu_seqlens_q = torch.arange(largest + 1, dtype=torch.int32, device=device)
        # Host mirrors the inputs are written to, pinned on CUDA: the driver may make a copy
        # from pageable memory wait for the device to run everything queued before it (the
        # step in flight), which would undo one-step-ahead scheduling.
        pin = device.type == "cuda"
        self._host_tokens = torch.empty((3, largest), dtype=torch.long, pin_memory=pin)
        self._host_seq_lens = torch.empty((largest,), dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.empty((largest, max_blocks), dtype=torch.int32, pin_memory=pin)
        # Recorded after each load's copies: the mirrors are rewritten only once read.
        self._copied = torch.cuda.Event() if pin else None

    def bucket(self, num_seqs: int) -> int:
        """The smallest bucket holding num_seqs rows (num_seqs <= max_batch_size)."""
        return next(b for b in self.buckets if b >= num_seqs)

    def load(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
    ) -> int:
        """Writes one decode batch (a token per sequence; block_tables [n, width]), padded;
        returns its bucket size."""
        n = len(input_ids)
        size = self.bucket(n)
        width = block_tables.shape[1]
        if self._copied is not None:
            self._copied.synchronize()
        tokens = self._host_tokens.numpy()
        tokens[0, :n] = input_ids
        tokens[1, :n] = positions
        tokens[2, :n] = slots
        tokens[:2, n:size] = 0
        tokens[2, n:size] = PAD_SLOT
        lens = self._host_seq_lens.numpy()
        lens[:n] = seq_lens
        lens[n:size] = PAD_SEQ_LEN
        tables = self._host_tables.numpy()
        tables[:n, :width] = block_tables
        tables[n:size, :width] = NULL_BLOCK
        self.tokens[:, :size].copy_(self._host_tokens[:, :size], non_blocking=True)
        self.seq_lens[:size].copy_(self._host_seq_lens[:size], non_blocking=True)
        self.block_tables[:size, :width].copy_(self._host_tables[:size, :width], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return size

    def metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.tokens[2, :size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,
            block_size=self.block_size,
            seq_lens_host=[],
            query_lens_host=[],
            decode_num_splits=choose_num_splits(
                size, self.num_heads, self.max_model_len, self.num_sms
            ),
            num_decodes=size,
        )


def forward_bucket(
    model: GPT2LMHeadModel, kv_cache: torch.Tensor, buffers: DecodeInputBuffers, size: int
) -> torch.Tensor:
    """Hidden states [size, C] of every row of the bucket in `buffers`: the captured work."""
    input_ids, positions = buffers.tokens[:2, :size]
    return model(input_ids, positions, kv_cache, buffers.metadata(size))


class DecodeGraphs:
    """One decode step's forward per batch-size bucket, all reading DecodeInputBuffers; a
    step loads its batch and replays its bucket's graph.

    With `capture` (CUDA), each bucket is captured as a graph, all in one memory pool;
    without, `run` does the same work eagerly over the same padded buffers, which is how
    the padding contract is tested on a CPU.
    """

    # The captured decode launch stores each row's key as it reads: no row may read another's.
    stores_first = False

    def __init__(
        self,
        model: GPT2LMHeadModel,
        kv_cache: torch.Tensor,
        max_batch_size: int,
        max_model_len: int,
        block_size: int,
        capture: bool,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.max_batch_size = max_batch_size
        self.buffers = DecodeInputBuffers(
            max_batch_size, max_model_len, block_size, model.config.n_head, kv_cache.device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each graph's output buffer
        if capture:
            self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        """Captures every bucket, largest first, all sharing one memory pool. The buffers
        hold padding rows only, so warm-up and capture store nothing in the cache."""
        sizes = self.buffers.buckets[::-1]
        works = [partial(forward_bucket, self.model, self.kv_cache, self.buffers, s) for s in sizes]
        for size, (graph, hidden) in zip(sizes, capture_graphs(works), strict=True):
            self.graphs[size], self.hidden[size] = graph, hidden

    @torch.inference_mode()
    def run(self, batch: HostBatch, pending: PendingInputs | None) -> torch.Tensor:
        """Hidden states [batch.num_seqs, C] of a decode-only batch (`batch.is_uniform_decode`),
        its unknown input tokens filled in on the device from `pending`. Replayed, the
        result is a view of graph memory, valid until the next replay."""
        size = self.buffers.load(
            batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables,
            batch.seq_lens,
        )  # fmt: skip
        if pending is not None:
            self.buffers.tokens[0].index_copy_(0, pending.rows, pending.tokens)
        if not self.graphs:  # not captured: the same work, op by op
            return forward_bucket(self.model, self.kv_cache, self.buffers, size)[: batch.num_seqs]
        self.graphs[size].replay()
        return self.hidden[size][: batch.num_seqs]
