"""Octavo's engine: GPT-2 over a paged KV cache with continuous batching."""

from octavo.engine.config import EngineConfig
from octavo.engine.frontend.llm import LLM
from octavo.engine.frontend.llm_engine import LLMEngine
from octavo.engine.frontend.outputs import CompletionOutput, RequestOutput
from octavo.engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from octavo.engine.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
