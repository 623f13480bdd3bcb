"""A CPU decode step of a few sequences as one operator call (kernels/cpu/gpt2_decode.cpp):
the CPU's counterpart of a full CUDA graph, dispatched the same way (CUDAGraphMode.FULL).

At batch 1 a GPT-2 token's products take a few milliseconds, and the layers' small ops and
the Python between them, run op by op, took as long again (docs/benchmarks/history.md,
"2026-12-01: one user at a time"). The fused step runs the embeddings, every block and the final
LayerNorm over the weights the model's linear layers already packed for small products
(`small`, kernels/small_gemm.py), reading and writing the model's own paged KV cache; the
LM head then runs as the model's (its small product too). Its twin is the model's forward,
op by op, which every other step takes.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch

from octavo.engine.worker.input_batch import HostBatch, PendingInputs
from octavo.engine.worker.models.gpt2 import AddLayerNorm, GPT2Block, GPT2LMHeadModel
from octavo.kernels import small_gemm


def _product(layer: torch.nn.Module) -> list[torch.Tensor] | None:
    """A linear layer's small weight as the operator's four tensors (packed, bias, w_scale,
    code_sums128; empty for what it has none of), or None where it has none."""
    small = getattr(layer, "small", None)  # a PackedLinear's or an Int8Linear's
    if small is None:
        return None
    optional = (small.bias, small.w_scale, small.code_sums128)
    return [small.packed, *(torch.empty(0) if t is None else t for t in optional)]


def _norm(norm: AddLayerNorm) -> list[torch.Tensor]:
    return [norm.weight.detach().float().contiguous(), norm.bias.detach().float().contiguous()]


class FusedDecode:
    """Uniform decode steps (HostBatch.is_uniform_decode) of up to MAX_ROWS sequences in one
    call. `build` returns None for a model it cannot run: not on a CPU, a product without a
    small weight (float32 and float16 models, a CPU without the kernels, LoRA-wrapped
    layers), an MLP activation other than the tanh GELU, no layers."""

    max_batch_size = small_gemm.MAX_ROWS
    # Each layer stores every row's K/V before any row attends: rows may share a sequence.
    stores_first = True

    def __init__(self, decoder: Any, kv_cache: torch.Tensor):  # a torch.classes object
        self.decoder = decoder
        self.kv_cache = kv_cache

    @classmethod
    def build(cls, model: GPT2LMHeadModel, kv_cache: torch.Tensor) -> FusedDecode | None:
        config = model.config
        if (
            kv_cache.device.type != "cpu"
            or kv_cache.dtype not in (torch.bfloat16, torch.float32)
            or not len(model.h)
        ):
            return None
        blocks = cast(list[GPT2Block], list(model.h))
        tensors = [model.wte.weight.detach(), model.wpe.weight.detach(), *_norm(model.ln_f)]
        for block in blocks:
            if not block.mlp.tanh_gelu:
                return None
            layers = (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
            products = [_product(layer) for layer in layers]
            if any(p is None for p in products):
                return None
            attn, proj, fc, mproj = cast(list[list[torch.Tensor]], products)
            tensors += [*_norm(block.ln_1), *attn, *proj, *_norm(block.ln_2), *fc, *mproj]
        dims = [
            config.n_layer, config.n_embd, config.n_head, config.num_kv_heads, config.head_dim,
            config.inner_dim, *blocks[0].attn.qkv_layout(),
        ]  # fmt: skip
        scales = [block.attn.scale for block in blocks]
        decoder = torch.classes.octavo_cpu.GPT2Decoder(
            tensors, dims, scales, config.layer_norm_epsilon
        )
        return cls(decoder, kv_cache)

    @torch.inference_mode()
    def run(self, batch: HostBatch, pending: PendingInputs | None) -> torch.Tensor:
        """Hidden states [batch.num_seqs, C] of a uniform decode batch, its unknown input
        tokens (sampled by the previous step) taken from `pending`."""
        input_ids = torch.from_numpy(batch.input_ids)
        if pending is not None:
            input_ids = input_ids.index_copy(0, pending.rows, pending.tokens)
        return self.decoder.forward(
            input_ids,
            torch.from_numpy(batch.positions),
            self.kv_cache,
            torch.from_numpy(batch.slot_mapping),
            torch.from_numpy(np.ascontiguousarray(batch.block_tables)),
            torch.from_numpy(batch.seq_lens),
        )
