"""Engine configuration: one frozen dataclass that every layer reads, validated once."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from octavo.engine.speculative import SpeculativeConfig

if TYPE_CHECKING:
    import torch

# The dtype names EngineConfig accepts, each a torch attribute (torch.float16). torch loads
# only where a device or dtype is resolved: the `octavo` command parses its flags without it.
DTYPES = ("float32", "float16", "bfloat16")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_ATTENTION_BACKENDS = ("auto", "torch", "triton")
# vLLM's --scheduling-policy, and fair (engine/core/request_queue.py says what each does).
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
# vLLM's flag and name; quantization.py says what int8 does.
QUANTIZATIONS = ("int8",)
# The default prefill_interval where decode steps replay CUDA graphs: the interval measured
# against admitting every step (docs/benchmarks/history.md, "prefill interval").
GRAPH_PREFILL_INTERVAL = 8
# A CPU KV cache of this size holds tens of thousands of tokens even for GPT-2 xl. It is
# zeroed at startup (ModelRunner), so all of it is resident from then on.
DEFAULT_CPU_KV_CACHE_GB = 2.0


def torch_has_gpu_build() -> bool:
    """Whether the installed torch may reach a GPU through torch.cuda: its CUDA or ROCm
    library is there (a CPU wheel has neither, and its torch.cuda.is_available() is always
    False), read from its files without importing it. True when that cannot be told."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True
    lib = Path(spec.submodule_search_locations[0]) / "lib"
    return any(lib.glob("*torch_cuda*")) or any(lib.glob("*torch_hip*"))


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is asked to run; the one source of the engine's settings.

    Each field's metadata["help"] (and "choices") is what `octavo serve --help` shows: the
    CLI flags (`--max-num-seqs` for max_num_seqs, ...) and the keyword arguments of the
    offline `LLM` are generated from these fields. The properties below resolve "auto".
    """

    model: str = field(
        metadata={"help": "Hugging Face-format folder or hub id, model_type gpt2 or "
                  "gpt_bigcode (or, with --load-format dummy, gpt2 / gpt2-medium / gpt2-large "
                  "/ gpt2-xl / gpt_bigcode or a folder with only config.json)"}
    )  # fmt: skip
    dtype: str = field(
        default="auto", metadata={"help": "weights and KV cache dtype (auto: float16 on CUDA; "
                                  "on CPU bfloat16 where the CPU computes it (AMX or "
                                  "AVX512-BF16), float32 elsewhere)", "choices": ("auto", *DTYPES)}
    )  # fmt: skip
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto"})
    quantization: str | None = field(
        default=None,
        metadata={"help": "int8: int8 weights (per output channel) and activations (per "
                  "token) on the CPU's int8 units, on CPU only (the --dtype is that of "
                  "activations, biases and the KV cache); fastest at small batches "
                  "(docs/benchmarks/history.md, \"int8 weights\")",
                  "choices": QUANTIZATIONS},
    )  # fmt: skip
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    num_blocks: int | None = field(
        default=None,
        metadata={"help": "KV cache size in blocks, block 0 reserved (default: from "
                  "--kv-cache-gb on CPU, --gpu-memory-utilization on CUDA)"},
    )  # fmt: skip
    kv_cache_gb: float | None = field(
        default=None,
        metadata={"help": "KV cache size on CPU when --num-blocks is not given (default "
                  f"{DEFAULT_CPU_KV_CACHE_GB:g}); allocated and zeroed at startup, so the "
                  "engine holds all of it from the start"},
    )  # fmt: skip
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": "fraction of the GPU's memory for weights, activations "
                               "and the KV cache"}
    )  # fmt: skip
    max_num_seqs: int = field(default=256, metadata={"help": "sequences running at once"})
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "token budget of one step (prefill chunks + decodes)"}
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest sequence (default: the model's n_positions)"}
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata={"help": "whom to admit and preempt next: fcfs (arrival order); priority "
                  "(vLLM's: a request's priority, lower first, ties by arrival; a less "
                  "urgent running request is preempted to admit a more urgent one); fair (an "
                  "equal share of tokens per user, the API key or the request's user: the "
                  "least served user's request next, and a user below its share of the "
                  "sequence seats takes one from the most served user above it)",
                  "choices": SCHEDULING_POLICIES},
    )  # fmt: skip
    fair_prompt_token_weight: float = field(
        default=1.0, metadata={"help": "fair policy: the service a prompt token counts for"}
    )
    fair_output_token_weight: float = field(
        default=2.0,
        metadata={"help": "fair policy: the service a generated token counts for (the "
                  "virtual token counter's default: a decode costs more than a prefill "
                  "token)"},
    )  # fmt: skip
    prefill_interval: int | None = field(
        default=None,
        metadata={"help": "while sequences decode, admit waiting requests (start their "
                  "prefill) at most every this many steps, at once when nothing runs: the "
                  "steps between stay decode-only, which CUDA graphs replay, at the cost of "
                  "up to this many steps of waiting (TGI's max_waiting_tokens). Default: "
                  f"{GRAPH_PREFILL_INTERVAL} where decode steps replay CUDA graphs, whose "
                  "steps with prefills run eagerly at several times a graph step's cost; 1 "
                  "elsewhere"},
    )  # fmt: skip
    load_format: str = field(
        default="auto", metadata={"help": "dummy: random weights of the config's shape",
                                  "choices": _LOAD_FORMATS}
    )  # fmt: skip
    seed: int = field(default=0, metadata={"help": "seed of the engine's shared generator"})
    attention_backend: str = field(
        default="auto", metadata={"help": "triton on CUDA, torch on CPU unless named",
                                  "choices": _ATTENTION_BACKENDS}
    )  # fmt: skip
    enforce_eager: bool = field(
        default=False, metadata={"help": "run every step op by op: no decode step replayed "
                                 "from CUDA graphs (CUDA), none fused into one call (CPU)"}
    )  # fmt: skip
    piecewise_cuda_graphs: bool | None = field(
        default=None,
        metadata={"help": "also replay the steps decode graphs do not take (steps that "
                  "prefill) from CUDA graphs, piecewise: every layer's work but attention "
                  "captured per token-count bucket up to --max-num-batched-tokens, "
                  "attention launched between the pieces (vLLM's piecewise graphs). Needs "
                  "CUDA graphs: CUDA, Triton attention, no --enforce-eager. Default: on "
                  "wherever decode steps replay CUDA graphs, since an eager step that "
                  "prefills is bound by the host's launches"},
    )  # fmt: skip
    enable_lora: bool = field(
        default=False,
        metadata={"help": "serve LoRA adapters (PEFT's format: adapter_config.json and "
                  "adapter_model.safetensors) over the base model, requests of several "
                  "adapters and of the base in one batch. CUDA graphs are not captured "
                  "with it"},
    )  # fmt: skip
    max_loras: int = field(
        default=1, metadata={"help": "with --enable-lora: distinct adapters in one batch"}
    )
    max_lora_rank: int = field(
        default=16, metadata={"help": "with --enable-lora: the largest adapter rank served"}
    )
    max_cpu_loras: int | None = field(
        default=None,
        metadata={"help": "with --enable-lora: adapters kept loaded in host memory (default: "
                  "--max-loras); others are read again from their folder when used"},
    )  # fmt: skip
    enable_prefix_caching: bool = field(
        default=True,
        metadata={"help": "reuse the KV blocks of prompt prefixes computed before (full "
                  "blocks, found by the hash of their tokens and prefix)"},
    )  # fmt: skip
    async_scheduling: bool | None = field(
        default=None,
        metadata={"help": "schedule each step while the previous one runs; its tokens reach "
                  "the next step on the device and the host one step later (off while a request "
                  "runs that needs every token first: beam search, bad words, prompt "
                  "logprobs, structured outputs, speculation). Default: on CUDA, "
                  "where it was measured faster, and off on CPU, where the forward leaves "
                  "nothing to overlap"},
    )  # fmt: skip
    speculative_config: str | None = field(
        default=None,
        metadata={"help": "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", "
                  "\"num_speculative_tokens\": k, \"prompt_lookup_min\": a, "
                  "\"prompt_lookup_max\": b, \"disable_by_batch_size\": n}: each step "
                  "a sequence proposes up to k tokens from its own prompt and output and "
                  "the model verifies them at once; {\"model\": PATH, "
                  "\"num_speculative_tokens\": k}: the greedy tokens of a draft model "
                  "with the same vocabulary propose them. Requests without penalties, "
                  "min_tokens, bad words or structured outputs speculate (greedy output "
                  "unchanged, sampled output in the same distribution); others run as "
                  "usual. The offline LLM also takes a dict"},
    )  # fmt: skip
    stream_interval: int = field(
        default=1,
        metadata={"help": "a stream's first token is sent at once, then one event per this "
                  "many tokens of the stream (its finish flushes): fewer, larger events cost "
                  "the server less CPU per token"},
    )  # fmt: skip

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
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_interval",
            "stream_interval",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:  # prefill_interval None: by device
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.fair_prompt_token_weight < 0 or self.fair_output_token_weight <= 0:
            raise ValueError(
                "fair_prompt_token_weight must be >= 0 and fair_output_token_weight > 0, got "
                f"{self.fair_prompt_token_weight} and {self.fair_output_token_weight}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        for name, allowed in (
            ("load_format", _LOAD_FORMATS),
            ("attention_backend", _ATTENTION_BACKENDS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.piecewise_cuda_graphs and not self.uses_cuda_graphs:
            raise ValueError(
                "piecewise_cuda_graphs needs CUDA graphs: device cuda, attention_backend "
                "triton (the default there) and no enforce_eager"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}"
            )
        if isinstance(self.speculative_config, Mapping):  # the offline LLM's dict
            object.__setattr__(self, "speculative_config", json.dumps(self.speculative_config))
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)  # refused at start, by name
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.enable_lora and self.speculative_config is not None:
            raise ValueError(
                "speculative_config: speculative decoding with LoRA adapters is not "
                "supported; leave one of --speculative-config and --enable-lora unset"
            )
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {DTYPES}, got {self.dtype!r}")

    @property
    def device_type(self) -> str:
        """ "cpu", "cuda", ...: what `torch_device` resolves to, learned without importing
        torch where that is certain (a process that runs no model, an API process, needs
        it): `device` as written, and "auto" with a torch built for no GPU."""
        if self.device == "auto":
            return self.torch_device.type if torch_has_gpu_build() else "cpu"
        return self.device.partition(":")[0]

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config`, parsed (None: no speculation)."""
        spec = self.speculative_config
        return None if spec is None else SpeculativeConfig.parse(spec)

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def uses_async_scheduling(self) -> bool:
        """Whether steps are scheduled one ahead: `async_scheduling`, or by device if unset."""
        asynchronous = self.async_scheduling
        return self.device_type == "cuda" if asynchronous is None else asynchronous

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs: Triton attention on CUDA, not eager, no
        LoRA (the step's rows per adapter are not an input of the captured graphs)."""
        return self._runs_whole_decodes("cuda", "triton")

    @property
    def uses_fused_decode(self) -> bool:
        """Whether small decode steps run as one fused call (engine/worker/fused_decode.py,
        where the model allows): the torch backend on a CPU, not eager, no LoRA (the fused
        products have no adapters)."""
        return self._runs_whole_decodes("cpu", "torch")

    def _runs_whole_decodes(self, device_type: str, backend_name: str) -> bool:
        """Whether decode steps run whole (not op by op): on `device_type` with
        `backend_name`'s attention, not eager, no LoRA."""
        return (
            self.device_type == device_type
            and self.backend_name == backend_name
            and not self.enforce_eager
            and not self.enable_lora
        )

    @property
    def uses_piecewise_graphs(self) -> bool:
        """Whether steps that prefill replay piecewise graphs: `piecewise_cuda_graphs`, or
        wherever decode steps replay CUDA graphs if unset."""
        piecewise = self.piecewise_cuda_graphs
        return self.uses_cuda_graphs if piecewise is None else piecewise

    @property
    def effective_prefill_interval(self) -> int:
        """The steps between admissions while sequences decode: `prefill_interval`, or by
        whether decode steps replay CUDA graphs if unset."""
        if self.prefill_interval is None:
            return GRAPH_PREFILL_INTERVAL if self.uses_cuda_graphs else 1
        return self.prefill_interval

    @property
    def backend_name(self) -> str:
        """ "triton" on CUDA and "torch" elsewhere, unless one is named."""
        if self.attention_backend == "auto":
            return "triton" if self.device_type == "cuda" else "torch"
        return self.attention_backend

    @property
    def torch_dtype(self) -> torch.dtype:
        """float16 on CUDA; on CPU bfloat16 where the CPU computes it natively
        (`cpu_computes_bfloat16`), float32 elsewhere; unless a dtype is named."""
        import torch

        if self.dtype == "auto":
            if self.torch_device.type == "cuda":
                return torch.float16
            return torch.bfloat16 if cpu_computes_bfloat16() else torch.float32
        return getattr(torch, self.dtype)


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AMX tiles or AVX512-BF16), as vLLM's CPU
    backend asks before it defaults to bfloat16. Elsewhere oneDNN emulates it, slower than
    float32."""
    import torch

    # Private, but the only way torch says it; vLLM's CPU backend asks torch._C._cpu too.
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_computes_int8() -> bool:
    """Whether this CPU has int8 dot-product units (AVX512-VNNI or AMX), which oneDNN's int8
    matmul kernels need. Elsewhere oneDNN takes its reference kernel, about a thousand times
    slower, so `--quantization int8` is refused there."""
    import torch

    return bool(torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported())
