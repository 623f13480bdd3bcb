"""Attention through the Triton kernels: the GPU path (on CPU, the interpreter for tests)."""

from __future__ import annotations

import torch

from octavo.engine.worker.attention.backend import AttentionBackend, AttentionMetadata
from octavo.kernels.copy_blocks import copy_blocks
from octavo.kernels.paged_attention import paged_attention


class TritonAttentionBackend(AttentionBackend):
    """One paged_attention call for the whole mixed batch per layer, given the step's keys
    and values: it stores the decodes' inside the decode kernel and the rest first. Where
    decode rows share a sequence, a program of the decode launch could read a slot another
    is still writing: those steps store every key first, then attend over the cache.

    Keys are located per position through the block table, so any block size works; the
    metadata needs no per-step preparation beyond what the runner builds (a mixed batch's
    leading decodes included, which the kernel runs on its decode path), which keeps a
    decode step free of host work and capturable in a CUDA graph.
    """

    name = "triton"
    fused_layer_norm = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        # Where decode rows share a sequence, every key is stored first: the kernels only read.
        stored = metadata.decodes_share_sequences
        if stored:
            # Such steps run eagerly or piecewise, never padded: every slot is a real one.
            num_kv_heads, head_dim = k.shape[1], k.shape[2]
            kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k)
            kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v)
        return paged_attention(
            q,
            kv_cache[0],
            kv_cache[1],
            metadata.block_tables,
            metadata.seq_lens,
            metadata.cu_seqlens_q,
            metadata.max_seqlen_q,
            metadata.max_seqlen_k,
            out,
            scale,
            num_splits=metadata.decode_num_splits,
            num_decodes=metadata.num_decodes,
            key=None if stored else k,
            value=None if stored else v,
            slot_mapping=None if stored else metadata.slot_mapping,
        )

    def copy_blocks(self, kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
        copy_blocks(kv_cache, block_mapping)
