"""Octavo: a high-throughput GPT-2 inference server (paged KV cache, continuous batching,
Triton kernels, in-engine beam search, an OpenAI-compatible HTTP API).

    from octavo import LLM, SamplingParams, BeamSearchParams

The repository keeps its top-level folders (engine/, kernels/, server/); this package holds
them as octavo.engine, octavo.kernels and octavo.server (links in a checkout, real folders in
the installed wheel) beside its own octavo.bench (the load-test client of `octavo bench
serve`), so `octavo` is the only top-level import an install adds. The repository's
benchmarks/ are not part of it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ loads them
    from octavo.engine import (
        LLM,
        BeamSearchParams,
        CompletionOutput,
        EngineConfig,
        LLMEngine,
        LoRARequest,
        RequestOutput,
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )

# The public API is the engine's (octavo.engine.__all__: LLM, SamplingParams, ...), loaded
# on first use: `octavo bench serve`, and the benchmarks that measure no model (through
# octavo.bench.host), must not pay for torch.
__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("octavo.engine"), name)
    raise AttributeError(f"module 'octavo' has no attribute {name!r}")
