"""Octavo: a high-throughput GPT-2 inference server (paged KV cache, continuous batching,
Triton kernels, in-engine beam search, an OpenAI-compatible HTTP API).

    from octavo import LLM, SamplingParams, BeamSearchParams

The repository keeps its top-level folders (engine/, kernels/, server/, benchmarks/); this
package holds them as octavo.engine, octavo.kernels, octavo.server and octavo.benchmarks
(links in a checkout, real folders in the installed wheel), so `octavo` is the only
top-level import an install adds.
"""

# The public API is the engine's (octavo.engine.__all__: LLM, SamplingParams, ...).
from octavo.engine import *  # noqa: F403
from octavo.engine import __all__ as __all__
