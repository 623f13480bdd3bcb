"""GPT-2 over a paged KV cache. Module names mirror the Hugging Face checkpoint's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from octavo.engine.worker.attention.backend import AttentionBackend, AttentionMetadata

# Activations whose math is exactly GELU with the tanh approximation.
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


@dataclass(frozen=True)
class GPT2Config:
    """The parts of a Hugging Face GPT2Config this model uses; `from_hf_dict` refuses the rest."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | None = 50256

    @property
    def flops_per_token(self) -> int:
        """Multiply-adds x 2 of one decode token's matrix products (attention over the
        context excluded): 12 n_embd^2 per layer (QKV, out, 4x MLP) plus the LM head."""
        per_layer = 4 * self.n_embd * self.n_embd + 2 * self.n_embd * self.inner_dim
        return 2 * (self.n_layer * per_layer + self.vocab_size * self.n_embd)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner_dim(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> GPT2Config:
        """Builds a config from config.json, refusing flags this model would silently ignore."""
        model_type = cfg.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise ValueError(f"config.json: model_type {model_type!r} is not supported (gpt2 only)")
        refused = {
            "add_cross_attention": False,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "scale_attn_weights": True,
        }
        for name, supported in refused.items():
            if name in cfg and bool(cfg[name]) != supported:
                raise ValueError(f"config.json: {name}={cfg[name]!r} is not supported")
        activation = cfg.get("activation_function", "gelu_new")
        if activation not in _TANH_GELU:
            raise ValueError(
                f"config.json: activation_function={activation!r} is not supported "
                f"(one of {_TANH_GELU})"
            )
        n_embd, n_head = cfg.get("n_embd", 768), cfg.get("n_head", 12)
        if n_embd % n_head:
            raise ValueError(f"config.json: n_embd={n_embd} is not divisible by n_head={n_head}")
        return cls(
            vocab_size=cfg.get("vocab_size", 50257),
            n_positions=cfg.get("n_positions", 1024),
            n_embd=n_embd,
            n_layer=cfg.get("n_layer", 12),
            n_head=n_head,
            n_inner=cfg.get("n_inner"),
            layer_norm_epsilon=cfg.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )


class GPT2Attention(nn.Module):
    def __init__(self, config: GPT2Config, backend: AttentionBackend):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.backend = backend

    def forward(
        self, x: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens, width = x.shape
        # [T, 3C] -> three strided [T, H, D] views; the backend stores K/V from them directly.
        q, k, v = self.c_attn(x).split(width, dim=-1)
        q = q.view(num_tokens, self.n_head, self.head_dim)
        k = k.view(num_tokens, self.n_head, self.head_dim)
        v = v.view(num_tokens, self.n_head, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale)  # [T, H, D]
        return self.c_proj(out.reshape(num_tokens, width))


class GPT2MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.inner_dim)
        self.c_proj = nn.Linear(config.inner_dim, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config, backend: AttentionBackend):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, backend)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(
        self, x: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, metadata)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(nn.Module):
    """GPT-2 on a flat batch of tokens from many sequences.

    forward(input_ids [T], positions [T], kv_cache [L, 2, num_blocks, block_size, H, D],
    metadata) -> hidden states [T, C]; compute_logits(hidden [S, C]) -> [S, vocab] float32, to
    be called only on the rows that sample.
    """

    def __init__(self, config: GPT2Config, backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, backend) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight
        # lm_head's weight padded with zero rows (pad_lm_head); None computes it unpadded.
        self.lm_head_padded: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)  # [T, C]
        for layer, block in enumerate(self.h):
            x = block(x, kv_cache[layer], metadata)
        return self.ln_f(x)

    def pad_lm_head(self, multiple: int) -> None:
        """Stores lm_head's weight with zero rows up to a multiple of `multiple`, so that the
        logits' row stride is aligned for the matrix units; compute_logits drops the padded
        columns. The weight (and the tied embedding) become views of the padded tensor: no
        second copy is kept. Call once, after loading and the final dtype cast."""
        weight = self.lm_head.weight
        vocab = weight.shape[0]
        rows = -(-vocab // multiple) * multiple
        if rows == vocab:
            return
        padded = weight.new_zeros(rows, weight.shape[1])
        with torch.no_grad():
            padded[:vocab] = weight
        view = nn.Parameter(padded[:vocab], requires_grad=False)
        if self.lm_head.weight is self.wte.weight:
            self.wte.weight = view
        self.lm_head.weight = view
        self.lm_head_padded = padded

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_padded is None:
            return self.lm_head(hidden).float()
        logits = F.linear(hidden, self.lm_head_padded)  # [S, padded vocab]
        return logits[:, : self.config.vocab_size].float()
