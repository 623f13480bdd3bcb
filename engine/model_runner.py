"""Turns a SchedulerOutput into model inputs, runs GPT-2 and samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from octavo.engine.attention.backend import AttentionBackend, AttentionMetadata
from octavo.engine.block_manager import BlockManager
from octavo.engine.cuda_graphs import CUDAGraphRunner
from octavo.engine.models.gpt2 import GPT2LMHeadModel
from octavo.engine.sampler import (
    BeamCandidates,
    ModelRunnerOutput,
    Sampler,
    SamplerOutput,
    SamplingRequest,
)
from octavo.engine.scheduler import SchedulerOutput


@dataclass
class StepInputs:
    """A step's batch on the host, in scheduled order (decodes first)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    num_decodes: int = 0
    sample_rows: list[int] = field(default_factory=list)  # token rows that sample a token
    beam_rows: list[int] = field(default_factory=list)  # token rows that feed beam search
    requests: list[SamplingRequest] = field(default_factory=list)
    beam_candidates: int = 0  # top-k per beam row that every beam group of the step needs


class ModelRunner:
    """Owns the model and the KV cache tensor; executes one scheduled step at a time.

    kv_cache is [num_layers, 2, num_blocks, block_size, num_heads, head_dim]; block 0 (the
    null block) is zeroed and never written, so padded reads see zeros, not garbage.
    """

    def __init__(
        self,
        model: GPT2LMHeadModel,
        backend: AttentionBackend,
        block_manager: BlockManager,
        sampler: Sampler,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        config = model.config
        self.model = model
        self.backend = backend
        self.block_manager = block_manager
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        # torch.empty: untouched blocks cost no memory; every read slot is written first.
        self.kv_cache = torch.empty(
            (config.n_layer, 2, num_blocks, block_size, config.n_head, config.head_dim),
            dtype=dtype,
            device=device,
        )
        self.kv_cache[:, :, 0].zero_()
        self.graphs: CUDAGraphRunner | None = None

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
        if output.blocks_to_copy:
            # Before any store_kv of this step: a copy must see the block as it was.
            self.backend.copy_blocks(self.kv_cache, self._tensor(output.blocks_to_copy, torch.long))
        step = self._host_inputs(output)
        if not step.sample_rows and not step.beam_rows:
            self._forward(step)  # a step of prefill chunks that sample nothing yet
            return ModelRunnerOutput(SamplerOutput([], [], []))
        if self.graphs is not None and self._graph_fits(step):
            logits = self.graphs.run(
                step.input_ids, step.positions, step.slots, step.tables, step.seq_lens
            )
        else:
            hidden = self._forward(step)
            rows = self._tensor(step.sample_rows + step.beam_rows, torch.long)
            logits = self.model.compute_logits(hidden[rows])
        num_sampled = len(step.sample_rows)
        sampled = SamplerOutput([], [], [])
        if step.requests:
            sampled = self.sampler(logits[:num_sampled], step.requests)
        candidates = None
        if step.beam_rows:
            logprobs = torch.log_softmax(logits[num_sampled:], dim=-1)
            values, token_ids = logprobs.topk(min(step.beam_candidates, logprobs.shape[1]))
            candidates = BeamCandidates(values.cpu(), token_ids.cpu())
        return ModelRunnerOutput(sampled, candidates)

    def _host_inputs(self, output: SchedulerOutput) -> StepInputs:
        step = StepInputs()
        bs = self.block_size
        for item in output.scheduled:
            seq = item.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            table = self.block_manager.get_block_table(seq)
            step.input_ids.extend(seq.token_ids[start:end])
            step.positions.extend(range(start, end))
            step.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            step.seq_lens.append(end)
            step.query_lens.append(item.num_new_tokens)
            step.tables.append(table)
            if item.num_new_tokens == 1 and step.num_decodes == len(step.seq_lens) - 1:
                step.num_decodes += 1
            for target in item.sample_seqs:
                if item.group.beam is not None:
                    step.beam_rows.append(len(step.input_ids) - 1)
                    step.beam_candidates = max(
                        step.beam_candidates, item.group.beam.candidates_needed
                    )
                else:
                    step.sample_rows.append(len(step.input_ids) - 1)
                    step.requests.append(SamplingRequest(item.group.sampling, target))
        return step

    def _graph_fits(self, step: StepInputs) -> bool:
        """A decode-only batch whose every row samples once, in row order, within a bucket."""
        if self.graphs is None or step.num_decodes != len(step.seq_lens):
            return False
        if len(step.seq_lens) > self.graphs.max_batch_size:
            return False
        return step.sample_rows + step.beam_rows == list(range(len(step.seq_lens)))

    def _forward(self, step: StepInputs) -> torch.Tensor:
        max_blocks = max(len(t) for t in step.tables)
        cu_seqlens = [0]
        for q in step.query_lens:
            cu_seqlens.append(cu_seqlens[-1] + q)
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(step.slots, torch.long),
            block_tables=self._tensor(
                [t + [0] * (max_blocks - len(t)) for t in step.tables], torch.int32
            ),
            seq_lens=self._tensor(step.seq_lens, torch.int32),
            cu_seqlens_q=self._tensor(cu_seqlens, torch.int32),
            max_seqlen_q=max(step.query_lens),
            max_seqlen_k=max(step.seq_lens),
            block_size=self.block_size,
            seq_lens_host=step.seq_lens,
            query_lens_host=step.query_lens,
        )
        return self.model(
            self._tensor(step.input_ids, torch.long),
            self._tensor(step.positions, torch.long),
            self.kv_cache,
            self.backend.prepare(metadata),
        )

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)


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
