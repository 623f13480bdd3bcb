"""Turns a SchedulerOutput into model inputs, runs GPT-2 and samples."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.block_manager import BlockManager
from engine.models.gpt2 import GPT2LMHeadModel
from engine.sampler import ModelRunnerOutput, Sampler, SamplerOutput, SamplingRequest
from engine.scheduler import SchedulerOutput


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

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * model_config.n_layer * block_size * model_config.n_embd * element

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        if output.blocks_to_copy:
            # Before any store_kv of this step: a copy must see the block as it was.
            self.backend.copy_blocks(self.kv_cache, self._tensor(output.blocks_to_copy, torch.long))
        input_ids, positions, slots = [], [], []
        seq_lens, query_lens, tables = [], [], []
        sample_rows: list[int] = []
        beam_rows: list[int] = []
        requests: list[SamplingRequest] = []
        num_decodes = 0
        bs = self.block_size
        for item in output.scheduled:
            seq = item.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            table = self.block_manager.get_block_table(seq)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            query_lens.append(item.num_new_tokens)
            tables.append(table)
            if item.num_new_tokens == 1 and num_decodes == len(seq_lens) - 1:
                num_decodes += 1
            for target in item.sample_seqs:
                if item.group.beam is not None:
                    beam_rows.append(len(input_ids) - 1)
                else:
                    sample_rows.append(len(input_ids) - 1)
                    requests.append(SamplingRequest(item.group.sampling_params, target))

        max_blocks = max(len(t) for t in tables)
        cu_seqlens = [0]
        for q in query_lens:
            cu_seqlens.append(cu_seqlens[-1] + q)
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.long),
            block_tables=self._tensor(
                [t + [0] * (max_blocks - len(t)) for t in tables], torch.int32
            ),
            seq_lens=self._tensor(seq_lens, torch.int32),
            cu_seqlens_q=self._tensor(cu_seqlens, torch.int32),
            max_seqlen_q=max(query_lens),
            max_seqlen_k=max(seq_lens),
            num_decodes=num_decodes,
            block_size=bs,
            seq_lens_host=seq_lens,
            query_lens_host=query_lens,
        )
        hidden = self.model(
            self._tensor(input_ids, torch.long),
            self._tensor(positions, torch.long),
            self.kv_cache,
            self.backend.prepare(metadata),
        )
        rows = sample_rows + beam_rows
        if not rows:
            return ModelRunnerOutput(SamplerOutput([], [], []))
        logits = self.model.compute_logits(hidden[self._tensor(rows, torch.long)])
        sampled = SamplerOutput([], [], [])
        if requests:
            sampled = self.sampler(logits[: len(sample_rows)], requests)
        beam_logprobs = None
        if beam_rows:
            beam_logprobs = torch.log_softmax(logits[len(sample_rows) :], dim=-1)
        return ModelRunnerOutput(sampled, beam_logprobs)

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)
