"""The attention-backend interface: how GPT-2 layers store and read K/V in the paged cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from octavo.kernels.copy_blocks import copy_blocks_ref


@dataclass
class AttentionMetadata:
    """One step's batch layout, shared by every layer (built once per step by the runner).

    Sequences are laid out one after another in the token dimension; those with a single query
    token (decodes) come first. Shapes: slot_mapping [T] int64 (-1 = do not store),
    block_tables [S, max_blocks] int32 (padded with the null block 0), seq_lens [S] int32
    (tokens in the cache after this step, context included), cu_seqlens_q [S + 1] int32.
    The *_host lists are the same numbers on the host, for planning without a device sync.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    seq_lens_host: list[int]
    query_lens_host: list[int]
    # Split-KV factor for decode batches; None lets the kernel choose (CUDA graphs fix it).
    decode_num_splits: int | None = None
    # The leading sequences with one query token each (the input batch's count): backends
    # may run them as decodes; 0 (none counted) is always correct.
    num_decodes: int = 0
    # Whether several decode rows are positions of one sequence (a draft verified position
    # by position): each reads the keys the rows before it bring, so a backend stores every
    # row's K/V before any row reads (a launch that stores as it reads could race).
    decodes_share_sequences: bool = False


class AttentionBackend(ABC):
    """Stores a layer's new K/V into the cache and computes causal attention through it.

    kv_cache for one layer is [2, num_blocks, block_size, num_heads, head_dim]; q, k, v are
    [T, num_heads, head_dim] (possibly strided views of the fused projection); the result is
    [T, num_heads, head_dim]. Query token i of a sequence sits at absolute position
    context_len + i (context_len = seq_len - query_len) and sees keys 0..context_len + i.
    """

    name: str
    # Whether the model's residual adds and LayerNorms run as one Triton kernel each
    # (add_layer_norm): with the Triton backend, the GPU path (the interpreter on CPU).
    fused_layer_norm: bool = False

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """Per-step precomputation shared by all layers; returns the metadata `forward` takes."""
        return metadata

    def copy_blocks(self, kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
        """Copy-on-write: kv_cache[:, :, dst] = kv_cache[:, :, src] for each (src, dst) row of
        the int64 [num_pairs, 2] block_mapping, all layers, K and V."""
        copy_blocks_ref(kv_cache, block_mapping)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
