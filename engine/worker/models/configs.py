"""The configurations of the architectures Octavo serves, read from config.json, keyed by its
`model_type`.

Plain data, without torch: the API processes read a model's limits and chat template from
them, and only the engine core, which builds the model (registry.py), imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

# The MLP activations the model computes (gpt2.ACTIVATIONS implements each): every
# parameter-free activation of HF's ACT2FN, by its config name.
ACTIVATION_FUNCTIONS = (
    "gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_fast", "gelu_accurate",
    "gelu", "gelu_python", "gelu_10", "quick_gelu", "relu", "relu2", "relu6", "leaky_relu",
    "silu", "swish", "mish", "hardswish", "sigmoid", "tanh", "sqrtsoftplus", "laplace",
    "linear",
)  # fmt: skip


@dataclass(frozen=True)
class GPT2Config:
    """The parts of a Hugging Face GPT2Config this model uses; `from_hf_dict` refuses the rest.

    activation_function: the MLP's activation, a key of ACTIVATION_FUNCTIONS.
    scale_attn_weights: scores are scaled by 1/sqrt(head_dim) (else by 1).
    scale_attn_by_inverse_layer_idx: layer i's (0-based) scores are also divided by i + 1.
    (Both in `attention_scale`.)

    HF's reorder_and_upcast_attn is accepted and not stored: with it HF computes the scaled
    QK^T and the softmax in float32 whatever the model's dtype (on its eager path; its SDPA
    path ignores the flag), and both backends always do: the Triton kernels accumulate
    tl.dot in float32 (decode: float32 operands), scale the float32 scores and normalise in
    float32; torch's SDPA kernels accumulate and normalise in float32, its math fallback
    upcasting 16-bit inputs (torch's default, allow_fp16_bf16_reduction_math_sdp off). A
    product of two fp16 or bf16 numbers is exact in float32, so this is HF's upcast-then-
    multiply up to summation order. As in HF, the probabilities meet V in V's dtype.
    """

    # config.json's model_type this class reads (the registry's key).
    model_type: ClassVar[str] = "gpt2"

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
    activation_function: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False

    def __post_init__(self) -> None:
        if self.activation_function not in ACTIVATION_FUNCTIONS:
            raise ValueError(
                f"activation_function={self.activation_function!r} is not supported "
                f"(one of {sorted(ACTIVATION_FUNCTIONS)})"
            )

    @property
    def flops_per_token(self) -> int:
        """Multiply-adds x 2 of one decode token's matrix products (attention over the
        context excluded): QKV, out and MLP per layer (12 n_embd^2 for GPT-2's 3 n_embd QKV
        and 4x MLP) plus the LM head."""
        per_layer = (
            self.n_embd * self.qkv_width + self.n_embd * self.n_embd
            + 2 * self.n_embd * self.inner_dim
        )  # fmt: skip
        return 2 * (self.n_layer * per_layer + self.vocab_size * self.n_embd)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def num_kv_heads(self) -> int:
        """K/V heads per layer (the KV cache's head dimension): one per query head."""
        return self.n_head

    @property
    def qkv_width(self) -> int:
        """Output width of the fused c_attn: the queries, then keys and values of every K/V
        head."""
        return self.n_embd + 2 * self.num_kv_heads * self.head_dim

    @property
    def inner_dim(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    def attention_scale(self, layer: int) -> float:
        """The softmax scale of layer `layer` (0-based), computed as HF's GPT2Attention does
        (same operations in the same order, so the same float)."""
        scale = self.head_dim**-0.5 if self.scale_attn_weights else 1.0
        if self.scale_attn_by_inverse_layer_idx:
            scale /= float(layer + 1)
        return scale

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> GPT2Config:
        """Builds a config from config.json, refusing flags this model would silently ignore."""
        model_type = cfg.get("model_type", "gpt2")
        if model_type != cls.model_type:
            raise ValueError(f"config.json: model_type {model_type!r} is not {cls.model_type!r}")
        if cfg.get("add_cross_attention", False):
            raise ValueError(
                f"config.json: add_cross_attention={cfg['add_cross_attention']!r} is not supported"
            )
        values = cls._hf_fields(cfg)
        n_embd, n_head = values["n_embd"], values["n_head"]
        if n_embd % n_head:
            raise ValueError(f"config.json: n_embd={n_embd} is not divisible by n_head={n_head}")
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"config.json: {exc}") from exc

    @classmethod
    def _hf_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """This class's fields from config.json, with HF's defaults for absent keys: the
        class's own, but no BOS or EOS token (the class's are GPT-2's, for dummy presets)."""
        values = {f.name: cfg.get(f.name, f.default) for f in fields(cls)}
        values |= {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")}
        for flag in ("scale_attn_weights", "scale_attn_by_inverse_layer_idx"):
            values[flag] = bool(values[flag])
        return values


@dataclass(frozen=True)
class GPTBigCodeConfig(GPT2Config):
    """A Hugging Face GPTBigCodeConfig: GPT2Config's fields plus `multi_query`.

    GPTBigCode has no scale_attn_by_inverse_layer_idx (HF's model never reads it: it stays
    False). attention_softmax_in_fp32 and scale_attention_softmax_in_fp32 are accepted and
    not stored: the installed transformers keeps them on the config but never reads them,
    scaling the scores and normalising them in float32 whatever they say, and both backends
    always do (see GPT2Config on reorder_and_upcast_attn). Older transformers versions
    honoured them only for 16-bit models, where float32 is what they ask for when true (the
    default, and what every released checkpoint sets).
    """

    model_type: ClassVar[str] = "gpt_bigcode"

    activation_function: str = "gelu_pytorch_tanh"
    multi_query: bool = True

    @property
    def num_kv_heads(self) -> int:
        """One K/V head shared by every query head with multi_query, else one per head."""
        return 1 if self.multi_query else self.n_head

    @classmethod
    def _hf_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        # scale_attn_by_inverse_layer_idx: a GPT-2 flag GPTBigCode never reads.
        values = super()._hf_fields(cfg) | {"scale_attn_by_inverse_layer_idx": False}
        return values | {"multi_query": bool(values["multi_query"])}


CONFIGS: dict[str, type[GPT2Config]] = {
    config.model_type: config for config in (GPT2Config, GPTBigCodeConfig)
}
# What a config.json without `model_type` is taken for (older GPT-2 checkpoints omit it).
DEFAULT_MODEL_TYPE = "gpt2"


def config_from_hf_dict(cfg: dict[str, Any]) -> GPT2Config:
    """The configuration of a config.json, by its model_type; ValueError for an unknown type
    or a flag its architecture does not support."""
    model_type = cfg.get("model_type", DEFAULT_MODEL_TYPE)
    if model_type not in CONFIGS:
        raise ValueError(
            f"config.json: model_type {model_type!r} is not supported (one of {sorted(CONFIGS)})"
        )
    return CONFIGS[model_type].from_hf_dict(cfg)
