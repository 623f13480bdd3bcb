"""GPT-2 over a paged KV cache. Module names mirror the Hugging Face checkpoint's."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from octavo.engine.worker.attention.backend import AttentionBackend, AttentionMetadata
from octavo.engine.worker.models.configs import GPT2Config
from octavo.engine.worker.models.linear import Linear, linear
from octavo.kernels.layer_norm import add_layer_norm, add_layer_norm_ref

# QuickGELU's x * sigmoid(1.702 x): 1.702 is the constant with which the sigmoid best
# approximates the normal CDF (Hendrycks & Gimpel, the GELU paper), as in HF's quick_gelu.
QUICK_GELU_SCALE = 1.702
# gelu_10 is HF's ClippedGELUActivation(min=-10, max=10): exact GELU clipped to +-10 (a range
# meant for quantisation; GELU never goes below -0.17, so only the upper bound ever acts).
GELU_10_BOUND = 10.0
# laplace is HF's LaplaceActivation with its defaults (from MEGA): the CDF of a normal with
# mean mu ~ 1/sqrt(2) and standard deviation sigma ~ 1/(2 sqrt(pi)), in HF's own decimals.
LAPLACE_MU = 0.707107
LAPLACE_SIGMA = 0.282095


def _laplace(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf((x - LAPLACE_MU) / (LAPLACE_SIGMA * math.sqrt(2.0))))


_tanh_gelu = partial(F.gelu, approximate="tanh")
# Activation dtypes whose MLP takes the GELU in the matrix product's epilogue on CUDA. Not
# float32: there the epilogue's GELU strays from torch's by more than the unfused op strays
# from HF's (docs/benchmarks/history.md, the H200 sessions), so float32 keeps the separate
# op and its parity with HF on near-tied greedy and beam choices; in 16 bits the difference
# is far below the dtype's rounding.
EPILOGUE_GELU_DTYPES = (torch.float16, torch.bfloat16)

# The MLP's activation for each of configs.ACTIVATION_FUNCTIONS (every parameter-free
# activation of HF's ACT2FN, by its config name). HF writes the tanh-GELU
# family as several Python formulas (gelu_fast as tanh(0.7978845608 x (1 + 0.044715 x^2)));
# all are 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), 0.7978845608 being sqrt(2/pi) to
# ten digits, beyond float32: they differ from torch's fused tanh GELU by rounding only
# (<= 2.4e-7 in float32). gelu and gelu_python are the exact (erf) GELU. HF's prelu and
# xielu are left out: they have learned parameters, which this model does not load.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": _tanh_gelu,
    "gelu_pytorch_tanh": _tanh_gelu,
    "gelu_python_tanh": _tanh_gelu,
    "gelu_fast": _tanh_gelu,
    "gelu_accurate": _tanh_gelu,
    "gelu": F.gelu,
    "gelu_python": F.gelu,
    "gelu_10": lambda x: F.gelu(x).clamp(-GELU_10_BOUND, GELU_10_BOUND),
    "quick_gelu": lambda x: x * torch.sigmoid(QUICK_GELU_SCALE * x),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
    "relu6": F.relu6,
    "leaky_relu": F.leaky_relu,  # torch's default slope 0.01, as nn.LeakyReLU()
    "silu": F.silu,
    "swish": F.silu,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "laplace": _laplace,
    "linear": lambda x: x,
}


class GPT2Attention(nn.Module):
    """Causal self-attention through the paged cache; `split_qkv` reads the fused c_attn's
    layout, which subclasses (other checkpoints' layouts) override."""

    def __init__(self, config: GPT2Config, layer: int, backend: AttentionBackend):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.scale = config.attention_scale(layer)
        self.c_attn = Linear(config.n_embd, config.qkv_width)
        self.c_proj = Linear(config.n_embd, config.n_embd)
        self.backend = backend

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """c_attn's output [T, qkv_width] as strided views q [T, H, D] and k, v [T, H_kv, D]
        (the backend stores K/V from them directly). GPT-2's is [q | k | v], C wide each."""
        q, k, v = qkv.view(qkv.shape[0], 3, self.n_head, self.head_dim).unbind(1)
        return q, k, v

    def qkv_layout(self) -> tuple[int, int, int, int]:
        """Where split_qkv finds each head in a row of c_attn's output, as (q_head_stride,
        k_base, v_base, kv_head_stride): q of head h at h * q_head_stride, k of K/V head g at
        k_base + g * kv_head_stride, v likewise from v_base (the fused decode step reads it)."""
        d, q_width = self.head_dim, self.n_head * self.head_dim
        return d, q_width, 2 * q_width, d

    def attend(
        self, qkv: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """c_attn's output [T, qkv_width] -> the heads' attention output [T, H * D], before
        c_proj: the part of a layer that reads the paged cache."""
        q, k, v = self.split_qkv(qkv)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale)  # [T, H, D]
        return out.reshape(qkv.shape[0], self.n_head * self.head_dim)


class GPT2MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = Linear(config.n_embd, config.inner_dim)
        self.c_proj = Linear(config.inner_dim, config.n_embd)
        self.act = ACTIVATIONS[config.activation_function]
        self.tanh_gelu = self.act is _tanh_gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (A LoRA-wrapped c_fc, lora.py, has no plain weight: it takes the op-by-op path.)
        if (
            self.tanh_gelu
            and x.is_cuda
            and x.dtype in EPILOGUE_GELU_DTYPES
            and isinstance(self.c_fc, Linear)
        ):
            # On CUDA, c_fc's bias and the tanh GELU run in the matrix product's epilogue
            # (cuBLASLt's GELU_BIAS): one launch fewer per layer. Not on the CPU, where this
            # op applies the erf GELU instead. test_gpu_parity holds it to the tanh GELU at
            # every batch size.
            hidden = torch._addmm_activation(self.c_fc.bias, x, self.c_fc.weight.t(), use_gelu=True)
            return self.c_proj(hidden)
        return self.c_proj(self.act(self.c_fc(x)))


class AddLayerNorm(nn.Module):
    """LayerNorm of x + residual: forward(x, residual) -> (the norm, x + residual), the sum
    being the residual stream from there on. With `fused`, one Triton launch does both
    (add_layer_norm); else torch's add, then its LayerNorm. Its parameters are nn.LayerNorm's
    (`weight`, `bias`), so checkpoints load by the same names."""

    def __init__(self, width: int, eps: float, fused: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.eps = eps
        self.add_norm = add_layer_norm if fused else add_layer_norm_ref

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.add_norm(x, residual, self.weight, self.bias, self.eps)


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config, attn: GPT2Attention, fused_layer_norm: bool):
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = AddLayerNorm(config.n_embd, eps, fused_layer_norm)
        self.attn = attn
        self.ln_2 = AddLayerNorm(config.n_embd, eps, fused_layer_norm)
        self.mlp = GPT2MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output, not yet added to `residual` (at the first layer,
        the token embeddings; the residual is then the position embeddings). Returns this
        block's MLP output and the residual it is to be added to, so that the add fuses
        with the next LayerNorm."""
        qkv, residual = self.pre_attention(x, residual)
        return self.post_attention(self.attn.attend(qkv, kv_cache, metadata), residual)

    def pre_attention(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's work before attention, row by row: (c_attn's output, the residual)."""
        normed, residual = self.ln_1(x, residual)
        return self.attn.c_attn(normed), residual

    def post_attention(
        self, attended: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's work after attention, row by row: (the MLP's output, the residual it
        is to be added to)."""
        normed, residual = self.ln_2(self.attn.c_proj(attended), residual)
        return self.mlp(normed), residual


class LoadedEmbedding(nn.Embedding):
    """An embedding whose weight the loader writes (weights.py), so it skips torch's random
    init: on the meta device the model is built on, that init runs torch's Python reference
    of `normal_`, which imports torch._dynamo, a slow import no engine start needs
    (docs/benchmarks/history.md, "Startup")."""

    def reset_parameters(self) -> None:
        """Nothing to do: every weight is loaded (or drawn by the dummy loader)."""


class GPT2LMHeadModel(nn.Module):
    """GPT-2 on a flat batch of tokens from many sequences.

    forward(input_ids [T], positions [T], kv_cache [L, 2, num_blocks, block_size, H_kv, D],
    metadata) -> hidden states [T, C]; compute_logits(hidden [S, C]) -> [S, vocab] in the
    model's dtype, to be called only on the rows that sample. H_kv is config.num_kv_heads.
    """

    config_class: ClassVar[type[GPT2Config]] = GPT2Config
    attention_class: ClassVar[type[GPT2Attention]] = GPT2Attention
    # Checkpoint weights stored as HF's Conv1D ([in, out], nn.Linear's transpose): the
    # loader transposes them.
    conv1d_weights: ClassVar[tuple[str, ...]] = (
        "attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight",
    )  # fmt: skip

    def __init__(self, config: GPT2Config, backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.wte = LoadedEmbedding(config.vocab_size, config.n_embd)
        self.wpe = LoadedEmbedding(config.n_positions, config.n_embd)
        fused = backend.fused_layer_norm
        self.h = nn.ModuleList(
            GPT2Block(config, self.attention_class(config, i, backend), fused)
            for i in range(config.n_layer)
        )
        self.ln_f = AddLayerNorm(config.n_embd, config.layer_norm_epsilon, fused)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
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
        x, residual = self.embed(input_ids, positions)
        for layer, block in enumerate(self.h):
            x, residual = block(x, residual, kv_cache[layer], metadata)
        return self.final_norm(x, residual)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token embeddings, position embeddings) [T, C] each: the first block's x and
        residual."""
        return self.wte(input_ids), self.wpe(positions)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The hidden states [T, C]: ln_f of the last block's output added to the residual."""
        return self.ln_f(x, residual)[0]

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
        """[S, vocab] in the model's dtype: widening them is the sampler's call, since a
        greedy batch's argmax needs none (a [S, vocab] copy the size of the product)."""
        if self.lm_head_padded is None:
            return self.lm_head(hidden)
        return linear(hidden, self.lm_head_padded)[:, : self.config.vocab_size]  # padding dropped
