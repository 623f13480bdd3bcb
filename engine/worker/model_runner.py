"""Turns a SchedulerOutput into model inputs, runs GPT-2 and samples."""

from __future__ import annotations

import numpy as np
import torch

from octavo.engine.step_io import (
    BeamCandidates,
    ModelRunnerOutput,
    SamplerOutput,
    SchedulerOutput,
)
from octavo.engine.worker.attention.backend import AttentionBackend, AttentionMetadata
from octavo.engine.worker.cuda_graphs import CUDAGraphRunner
from octavo.engine.worker.input_batch import HostBatch, InputBatch
from octavo.engine.worker.models.gpt2 import GPT2LMHeadModel
from octavo.engine.worker.sampler import Sampler


class ModelRunner:
    """Owns the model and the KV cache tensor; executes one scheduled step at a time.

    kv_cache is [num_layers, 2, num_blocks, block_size, num_heads, head_dim]; block 0 (the
    null block) is zeroed and never written, so padded reads see zeros, not garbage. Inputs
    come from the persistent `InputBatch`; on CUDA each kind of input crosses to the device
    in one non-blocking copy from pinned memory.
    """

    def __init__(
        self,
        model: GPT2LMHeadModel,
        backend: AttentionBackend,
        sampler: Sampler,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        config = model.config
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        self.input_batch = InputBatch(max_num_seqs, max_model_len, block_size)
        # torch.empty: untouched blocks cost no memory; every read slot is written first.
        self.kv_cache = torch.empty(
            (config.n_layer, 2, num_blocks, block_size, config.n_head, config.head_dim),
            dtype=dtype,
            device=device,
        )
        self.kv_cache[:, :, 0].zero_()
        self.graphs: CUDAGraphRunner | None = None
        self._pinned: dict[str, torch.Tensor] = {}  # CUDA: staging buffer per input kind
        # Recorded after a step's copies: the next step waits on it before refilling the
        # pinned buffers, which a copy still in flight may be reading.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * model_config.n_layer * block_size * model_config.n_embd * element

    def enable_cuda_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        """Captures decode steps of up to max_batch_size sequences (CUDA + triton only)."""
        self.graphs = CUDAGraphRunner(
            self.model, self.kv_cache, max_batch_size, max_model_len, self.block_size
        )
        self.graphs.capture()

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        if self._copied is not None:
            self._copied.synchronize()
        if output.blocks_to_copy:
            # Before any store_kv of this step: a copy must see the block as it was.
            pairs = np.array(output.blocks_to_copy, dtype=np.int64)
            self.backend.copy_blocks(self.kv_cache, self._to_device("copies", pairs))
        batch = self.input_batch.prepare(output)
        if not len(batch.logits_rows):
            self._forward(batch)  # a step of prefill chunks that sample nothing yet
            return ModelRunnerOutput([], SamplerOutput([], [], []))
        graph_decode = batch.is_graph_decode
        if (
            self.graphs is not None
            and graph_decode
            and batch.num_seqs <= self.graphs.max_batch_size
        ):
            logits = self.graphs.run(batch)
        else:
            hidden = self._forward(batch)
            if not graph_decode:  # every row's logits, in order, need no gather
                hidden = hidden[self._to_device("logits_rows", batch.logits_rows)]
            logits = self.model.compute_logits(hidden)
        num_sampled = len(batch.requests)
        sampled = SamplerOutput([], [], [])
        if batch.requests:
            sampled = self.sampler(logits[:num_sampled], batch.requests)
        candidates = None
        if batch.beam_seq_ids:
            logprobs = torch.log_softmax(logits[num_sampled:], dim=-1)
            values, token_ids = logprobs.topk(min(batch.beam_top_k, logprobs.shape[1]))
            candidates = BeamCandidates(values.cpu(), token_ids.cpu())
        return ModelRunnerOutput(batch.sampled_seq_ids, sampled, batch.beam_seq_ids, candidates)

    def _forward(self, batch: HostBatch) -> torch.Tensor:
        metadata = AttentionMetadata(
            slot_mapping=self._to_device("slot_mapping", batch.slot_mapping),
            block_tables=self._to_device("block_tables", batch.block_tables),
            seq_lens=self._to_device("seq_lens", batch.seq_lens),
            cu_seqlens_q=self._to_device("cu_seqlens_q", batch.cu_seqlens_q),
            max_seqlen_q=int(batch.query_lens.max()),
            max_seqlen_k=int(batch.seq_lens.max()),
            block_size=self.block_size,
            seq_lens_host=batch.seq_lens.tolist(),
            query_lens_host=batch.query_lens.tolist(),
        )
        return self.model(
            self._to_device("input_ids", batch.input_ids),
            self._to_device("positions", batch.positions),
            self.kv_cache,
            self.backend.prepare(metadata),
        )

    def _to_device(self, kind: str, array: np.ndarray) -> torch.Tensor:
        """The array as a tensor on the runner's device: shared memory on CPU; on CUDA one
        non-blocking copy from this kind's pinned staging buffer."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return host
        staging = self._pinned.get(kind)
        if staging is None or staging.numel() < host.numel() or staging.dtype != host.dtype:
            staging = torch.empty(max(host.numel(), 1), dtype=host.dtype, pin_memory=True)
            self._pinned[kind] = staging
        staged = staging[: host.numel()].view(host.shape)
        staged.copy_(host)
        on_device = staged.to(self.device, non_blocking=True)
        assert self._copied is not None
        self._copied.record()
        return on_device


@torch.inference_mode()
def profile_activation_bytes(
    model: GPT2LMHeadModel,
    backend: AttentionBackend,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
) -> int:
    """Peak CUDA memory of the largest step beyond weights and KV cache: a prefill of
    max_num_batched_tokens tokens (as sequences of at most max_model_len) that samples
    max_num_seqs rows. The KV cache gets what is left after this."""
    config = model.config
    device = model.wte.weight.device
    lengths = [max_model_len] * (max_num_batched_tokens // max_model_len)
    if max_num_batched_tokens % max_model_len:
        lengths.append(max_num_batched_tokens % max_model_len)
    tables, next_block = [], 1
    for length in lengths:
        count = -(-length // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    cache = torch.zeros(
        (config.n_layer, 2, next_block, block_size, config.n_head, config.head_dim),
        dtype=model.wte.weight.dtype,
        device=device,
    )
    slots = [
        t[p // block_size] * block_size + p % block_size
        for t, n in zip(tables, lengths, strict=True)
        for p in range(n)
    ]
    width = max(len(t) for t in tables)
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        max_seqlen_q=max(lengths),
        max_seqlen_k=max(lengths),
        block_size=block_size,
        seq_lens_host=lengths,
        query_lens_host=lengths,
    )
    positions = torch.tensor([p for n in lengths for p in range(n)], device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hidden = model(torch.zeros_like(positions), positions, cache, backend.prepare(metadata))
    rows = torch.arange(max_num_seqs, device=device) % hidden.shape[0]
    torch.log_softmax(model.compute_logits(hidden[rows]), dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del cache, hidden
    torch.cuda.empty_cache()
    return peak
