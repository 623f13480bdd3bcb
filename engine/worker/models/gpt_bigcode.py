"""GPTBigCode (SantaCoder, StarCoder): GPT-2's layer with multi-query attention.

Everything but the attention's K/V heads and the checkpoint's layout is GPT-2's, so the
classes here extend those of gpt2.py: the same module names (`transformer.h.{i}.attn.c_attn`,
...), embeddings, LayerNorms, MLP, activations and tied LM head. The differences, read from
transformers' modeling_gpt_bigcode.py:

- multi_query=true (the released models): one K/V head shared by all query heads; c_attn is
  [q (n_embd) | k (head_dim) | v (head_dim)], so the KV cache holds one head per layer.
- multi_query=false: ordinary multi-head attention, c_attn laid out per head,
  [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], head_dim each.
- Weights are nn.Linear ([out, in]), not GPT-2's Conv1D: nothing is transposed on load.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from octavo.engine.worker.attention.backend import AttentionBackend
from octavo.engine.worker.models.configs import GPT2Config, GPTBigCodeConfig
from octavo.engine.worker.models.gpt2 import GPT2Attention, GPT2LMHeadModel


class GPTBigCodeAttention(GPT2Attention):
    """GPT-2's attention over config.num_kv_heads K/V heads, each shared by
    n_head // num_kv_heads query heads; only c_attn's layout differs."""

    def __init__(self, config: GPTBigCodeConfig, layer: int, backend: AttentionBackend):
        super().__init__(config, layer, backend)
        self.multi_query = config.multi_query

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens, head_dim = qkv.shape[0], self.head_dim
        if self.multi_query:
            # [T, C + 2D] -> q [T, H, D] and k, v [T, 1, D]
            q, k, v = qkv.split((self.n_head * head_dim, head_dim, head_dim), dim=-1)
            return q.view(num_tokens, self.n_head, head_dim), k[:, None], v[:, None]
        # [T, 3C] -> [T, H, 3D] (each head's q, k, v side by side) -> three [T, H, D] views
        q, k, v = qkv.view(num_tokens, self.n_head, 3 * head_dim).split(head_dim, dim=-1)
        return q, k, v

    def qkv_layout(self) -> tuple[int, int, int, int]:
        d, q_width = self.head_dim, self.n_head * self.head_dim
        if self.multi_query:
            return d, q_width, q_width + d, d
        return 3 * d, d, 2 * d, 3 * d


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    """GPT2LMHeadModel's contract, with GPTBigCode's attention and nn.Linear weights."""

    config_class: ClassVar[type[GPT2Config]] = GPTBigCodeConfig
    attention_class: ClassVar[type[GPT2Attention]] = GPTBigCodeAttention
    conv1d_weights: ClassVar[tuple[str, ...]] = ()
