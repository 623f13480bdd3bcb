"""What a PEFT LoRA adapter folder holds, checked against the base model without reading its
tensors (or importing torch): the API process checks an adapter when it is registered, the
worker before it loads the factors (engine/worker/lora.py).

An adapter adds `scaling * B @ A` to some of the four products of each layer (GPT-2's
`Conv1D`s `attn.c_attn`, `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`; GPTBigCode's `nn.Linear`s
of the same names), A [r, in_features] and B [out_features, r] as PEFT stores them whatever
`fan_in_fan_out` says. Anything else it could hold changes what it computes and is refused by
name, never ignored.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from octavo.engine.errors import ParameterError
from octavo.engine.worker.models.configs import GPT2Config

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# PEFT's key of a factor: base_model.model.[transformer.]h.{layer}.{target}.lora_{A|B}.weight
_KEY = re.compile(
    r"^base_model\.model\.(?:transformer\.)?h\.(\d+)\.("
    + "|".join(re.escape(t) for t in TARGETS)
    + r")\.lora_([AB])\.weight$"
)
# adapter_config.json settings that change what an adapter computes beyond A, B and the
# scaling.
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save (fully trained modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "lora_bias": "trained LoRA biases (lora_bias)",
    "target_parameters": "target_parameters",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}
_MAX_HEADER_BYTES = 100 << 20


def target_shape(config: GPT2Config, target: str) -> tuple[int, int]:
    """(in_features, out_features) of a target product of `config`'s layers."""
    return {
        "attn.c_attn": (config.n_embd, config.qkv_width),
        "attn.c_proj": (config.n_embd, config.n_embd),
        "mlp.c_fc": (config.n_embd, config.inner_dim),
        "mlp.c_proj": (config.inner_dim, config.n_embd),
    }[target]


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: its rank and scaling (lora_alpha / r, or / sqrt(r) with rsLoRA),
    and per adapted module ("h.{layer}.{target}") the keys of its A and B factors in
    ADAPTER_WEIGHTS."""

    path: Path
    rank: int
    scaling: float
    modules: dict[str, tuple[str, str]]


def read_adapter(name: str, path: str, config: GPT2Config, max_rank: int) -> AdapterSpec:
    """The adapter at `path`, checked against the base `config`; ParameterError naming
    `lora_path` for anything it cannot serve exactly: a missing or non-adapter folder, a
    setting or module this engine does not implement, a rank above max_rank, factors of
    another base's shapes."""
    folder = Path(path)

    def refuse(message: str) -> ParameterError:
        return ParameterError("lora_path", f"LoRA adapter {name!r}: {message}")

    if not folder.is_dir():
        raise refuse(f"{path!r} is not a folder")
    if not (folder / ADAPTER_CONFIG).is_file():
        raise refuse(f"no {ADAPTER_CONFIG} in {path!r}: not a PEFT adapter")
    try:
        settings = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise refuse(f"{ADAPTER_CONFIG} is not readable JSON ({exc})") from None
    peft_type = settings.get("peft_type") if isinstance(settings, dict) else None
    if peft_type != "LORA":
        raise refuse(f"peft_type {peft_type!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if settings.get(key):
            raise refuse(f"{what} is not supported")
    if settings.get("bias", "none") != "none":
        raise refuse(f"bias {settings['bias']!r} is not supported (only 'none')")
    rank, alpha = settings.get("r"), settings.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise refuse(f"r {rank!r} and lora_alpha {alpha!r} must be a positive int and a number")
    if rank > max_rank:
        raise refuse(f"rank {rank} is above max_lora_rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise refuse(f"no {ADAPTER_WEIGHTS} in {path!r}")
    try:
        shapes = _safetensors_shapes(folder / ADAPTER_WEIGHTS)
    except (OSError, ValueError, RecursionError, struct.error) as exc:
        raise refuse(f"{ADAPTER_WEIGHTS} is not a safetensors file ({exc})") from None
    factors: dict[str, dict[str, tuple[str, list[int]]]] = {}
    for key, shape in shapes.items():
        match = _KEY.match(key)
        if match is None:
            raise refuse(f"weight {key!r} is not a LoRA factor of {', '.join(TARGETS)}")
        layer, target, factor = int(match.group(1)), match.group(2), match.group(3)
        if layer >= config.n_layer:
            raise refuse(f"{key!r}: the base model has {config.n_layer} layers")
        factors.setdefault(f"h.{layer}.{target}", {})[factor] = (key, shape)
    modules = {}
    for module, pair in factors.items():
        if set(pair) != {"A", "B"}:
            raise refuse(f"{module} has lora_{''.join(pair)} but not both factors")
        (a_key, a_shape), (b_key, b_shape) = pair["A"], pair["B"]
        in_features, out_features = target_shape(config, module.split(".", 2)[2])
        if a_shape != [rank, in_features] or b_shape != [out_features, rank]:
            raise refuse(
                f"{module}'s factors are {tuple(a_shape)} and {tuple(b_shape)}, the base "
                f"needs ({rank}, {in_features}) and ({out_features}, {rank}): an adapter of "
                "another base model"
            )
        modules[module] = (a_key, b_key)
    if not modules:
        raise refuse("it holds no LoRA weights")
    return AdapterSpec(folder, rank, scaling, modules)


def _safetensors_shapes(file: Path) -> dict[str, list[int]]:
    """Each tensor's shape from a safetensors file's header (8 bytes of its length, then
    JSON), without reading the tensors."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"a header of {length} bytes")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    shapes = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(n, int) for n in shape):
            raise ValueError(f"tensor {key!r} has no shape")
        shapes[key] = shape
    return shapes
