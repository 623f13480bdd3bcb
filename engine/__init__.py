"""Octavo's engine: GPT-2 over a paged KV cache with continuous batching.

The public names load on first use, as `octavo`'s do: importing a light module of the
engine (its config, sampling parameters, messages) must not import torch, so that the
`octavo` command parses its flags, and says what is wrong with them, without it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see (re-exported); at run time __getattr__ loads them
    from octavo.engine.config import EngineConfig as EngineConfig
    from octavo.engine.frontend.llm import LLM as LLM
    from octavo.engine.frontend.llm_engine import LLMEngine as LLMEngine
    from octavo.engine.frontend.outputs import CompletionOutput as CompletionOutput
    from octavo.engine.frontend.outputs import RequestOutput as RequestOutput
    from octavo.engine.lora_request import LoRARequest as LoRARequest
    from octavo.engine.sampling_params import BeamSearchParams as BeamSearchParams
    from octavo.engine.sampling_params import RequestOutputKind as RequestOutputKind
    from octavo.engine.sampling_params import SamplingParams as SamplingParams
    from octavo.engine.structured_outputs import StructuredOutputsParams as StructuredOutputsParams

# Each public name, and the module that defines it.
_EXPORTS = {
    "LLM": "octavo.engine.frontend.llm",
    "BeamSearchParams": "octavo.engine.sampling_params",
    "CompletionOutput": "octavo.engine.frontend.outputs",
    "EngineConfig": "octavo.engine.config",
    "LLMEngine": "octavo.engine.frontend.llm_engine",
    "LoRARequest": "octavo.engine.lora_request",
    "RequestOutput": "octavo.engine.frontend.outputs",
    "RequestOutputKind": "octavo.engine.sampling_params",
    "SamplingParams": "octavo.engine.sampling_params",
    "StructuredOutputsParams": "octavo.engine.structured_outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'octavo.engine' has no attribute {name!r}")
