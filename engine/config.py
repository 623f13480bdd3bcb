"""Engine configuration: one frozen dataclass that every layer reads, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The dtype names EngineConfig accepts.
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_ATTENTION_BACKENDS = ("auto", "torch", "triton")
# A CPU KV cache of this size holds tens of thousands of tokens even for GPT-2 xl: the
# cache is allocated with torch.empty, so pages nobody touches cost no RAM.
DEFAULT_CPU_KV_CACHE_GB = 2.0


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is asked to run. `resolve()` turns "auto" values into concrete ones.

    - model: a Hugging Face-format folder, a hub id, or (with load_format="dummy") one of
      gpt2 / gpt2-medium / gpt2-large / gpt2-xl or a folder holding only config.json.
    - num_blocks: KV cache size in blocks (block 0 is the reserved null block); when None it
      comes from kv_cache_gb on CPU or gpu_memory_utilization on CUDA.
    - max_num_batched_tokens: token budget of one engine step (prefill chunks + decodes).
    - max_model_len: longest sequence (prompt + output); defaults to the model's n_positions.
    - attention_backend: "torch" (CPU path), "triton" (the kernels; on CPU only under the
      Triton interpreter, for tests) or "auto"; enforce_eager disables CUDA graphs.
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    load_format: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}"
            )
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}"
            )
        if self.attention_backend not in _ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {_ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {tuple(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def backend_name(self) -> str:
        """ "triton" on CUDA and "torch" elsewhere, unless one is named."""
        if self.attention_backend == "auto":
            return "triton" if self.torch_device.type == "cuda" else "torch"
        return self.attention_backend

    @property
    def torch_dtype(self) -> torch.dtype:
        """float32 on CPU and float16 on CUDA unless a dtype is named."""
        if self.dtype == "auto":
            return torch.float16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]
