"""The worker assembled from an EngineConfig: the model (and a draft model) loaded, the KV
cache sized, the runner built and its graphs captured. The engine core gets back data and
the two objects it steps (`Worker`); everything it sends them is step_io's."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from octavo import kernels
from octavo.engine.config import (
    DEFAULT_CPU_KV_CACHE_GB,
    EngineConfig,
    cpu_computes_bfloat16,
    cpu_computes_int8,
)
from octavo.engine.worker.attention.backend import AttentionBackend
from octavo.engine.worker.attention.torch_backend import TorchAttentionBackend
from octavo.engine.worker.attention.triton_backend import TritonAttentionBackend
from octavo.engine.worker.draft_model import DraftModelProposer
from octavo.engine.worker.grammar import GrammarMatchers
from octavo.engine.worker.lora import LoRAManager
from octavo.engine.worker.model_runner import ModelRunner, profile_activation_bytes
from octavo.engine.worker.models.configs import GPT2Config
from octavo.engine.worker.models.model_files import tokenizer_file
from octavo.engine.worker.models.weights import LoadedModel, load_model
from octavo.engine.worker.sampler import Sampler

_GIB = 1 << 30
logger = logging.getLogger(__name__)


@dataclass
class Worker:
    """What the engine core needs of the worker: the model's configuration and stop tokens,
    the context length served, the KV cache's block count (the block manager's), the runner
    that executes steps and, with a speculative draft model, its proposer."""

    model_config: GPT2Config
    eos_token_ids: list[int]  # the first is model_config.eos_token_id
    max_model_len: int
    num_blocks: int
    runner: ModelRunner
    drafter: DraftModelProposer | None


def make_backend(config: EngineConfig) -> AttentionBackend:
    """The configured attention backend; triton on CPU needs the Triton interpreter."""
    if config.backend_name == "torch":
        return TorchAttentionBackend()
    if config.torch_device.type != "cuda" and not kernels.interpreter_active():
        raise ValueError(
            "attention_backend='triton' needs CUDA, or on CPU the Triton "
            "interpreter (TRITON_INTERPRET=1 set before the engine is imported)"
        )
    return TritonAttentionBackend()


def load_worker(config: EngineConfig) -> Worker:
    """Loads and builds the worker for `config`; ValueError naming the setting a model or
    this machine cannot serve."""
    device, dtype = config.torch_device, config.torch_dtype
    _check_device(config, device, dtype)
    backend = make_backend(config)
    loaded = load_model(
        config.model, config.load_format, backend, device, dtype, config.seed, config.quantization
    )
    model_config = loaded.model.config
    n_positions = model_config.n_positions
    max_model_len = config.max_model_len or n_positions
    if max_model_len > n_positions:
        raise ValueError(
            f"max_model_len ({max_model_len}) exceeds the model's n_positions ({n_positions})"
        )
    draft_backend = make_backend(config)  # the draft model's layers' and its proposer's
    draft = _load_draft(config, model_config, draft_backend)
    models = [loaded] if draft is None else [loaded, draft]
    num_blocks = config.num_blocks or _default_num_blocks(config, backend, max_model_len, models)
    # Before the runner: it wraps the model's target products.
    lora = LoRAManager(loaded.model, config) if config.enable_lora else None
    generator = torch.Generator(device=device).manual_seed(config.seed)
    tokenizer = tokenizer_file(config.model, config.load_format)
    grammars = GrammarMatchers(tokenizer, model_config.vocab_size, model_config.eos_token_id)
    sampler = Sampler(generator, grammars)
    runner = ModelRunner(config, loaded.model, backend, sampler, num_blocks, max_model_len, lora)
    drafter = None
    if draft is not None:
        drafter = DraftModelProposer(
            draft.model, draft_backend, num_blocks, config.block_size,
            config.max_num_batched_tokens, device, dtype,
        )  # fmt: skip
    return Worker(model_config, loaded.eos_token_ids, max_model_len, num_blocks, runner, drafter)


def _check_device(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Refuses a quantization this device cannot compute; warns of an emulated bfloat16."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_computes_bfloat16():
        logger.warning(
            "dtype bfloat16 on a CPU without AMX or AVX512-BF16: its products are emulated "
            "and run slower than in float32; --dtype float32 (or auto) is faster here"
        )
    if config.quantization is None:
        return
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        raise ValueError(
            f"quantization {config.quantization!r} runs on a CPU with oneDNN only (its "
            f"int8 products), not on {device.type}"
            + ("" if device.type == "cpu" else "; leave --quantization unset there")
        )
    if not cpu_computes_int8():
        raise ValueError(
            f"quantization {config.quantization!r} needs a CPU with int8 units (AVX512-VNNI "
            "or AMX); on this one oneDNN's int8 products take its reference kernel, about "
            "a thousand times slower: leave --quantization unset here"
        )


def _load_draft(
    config: EngineConfig, target: GPT2Config, backend: AttentionBackend
) -> LoadedModel | None:
    """The speculative draft model, if one is configured; it must share the target's
    vocabulary."""
    spec = config.speculative
    if spec is None or spec.model is None:
        return None
    draft = load_model(
        spec.model, config.load_format, backend, config.torch_device,
        config.torch_dtype, config.seed, config.quantization,
    )  # fmt: skip
    if draft.model.config.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model {spec.model!r} has a vocabulary of "
            f"{draft.model.config.vocab_size} tokens, the target {target.vocab_size}: a draft "
            "model must share the target's"
        )
    return draft


def _default_num_blocks(
    config: EngineConfig, backend: AttentionBackend, max_model_len: int, models: list[LoadedModel]
) -> int:
    """The blocks of the caches of `models` (the target, then a draft model if any: a draft
    model's cache has as many blocks as the target's, so each block counts both). CPU:
    kv_cache_gb. CUDA: gpu_memory_utilization of the device, minus what is in use (weights,
    a draft model's included) and what the target's largest step needs on top (profiled
    with a dummy step)."""
    dtype, device = config.torch_dtype, config.torch_device
    per_block = sum(
        ModelRunner.kv_bytes_per_block(m.model.config, config.block_size, dtype) for m in models
    )
    if device.type == "cuda":
        activation = profile_activation_bytes(config, models[0].model, backend, max_model_len)
        # Blocks torch's allocator caches but no tensor holds (a previous engine's, say)
        # are free for this cache: hand them back before reading the device's free memory.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.gpu_memory_utilization - (total - free) - activation
    else:
        budget = (config.kv_cache_gb or DEFAULT_CPU_KV_CACHE_GB) * _GIB
    return max(int(budget // per_block), 2)
