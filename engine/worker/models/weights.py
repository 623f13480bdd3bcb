"""Builds a model's architecture (registry, by model_type) on the device and fills its weights
(safetensors or dummy); model_files.py finds the model and reads its configuration."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from octavo.engine.worker.attention.backend import AttentionBackend
from octavo.engine.worker.models.configs import GPT2Config
from octavo.engine.worker.models.gpt2 import GPT2LMHeadModel
from octavo.engine.worker.models.linear import PackedLinear, can_pack, replace_linears
from octavo.engine.worker.models.model_files import eos_token_ids, model_config
from octavo.engine.worker.models.quantization import Int8Linear
from octavo.engine.worker.models.registry import MODELS

# Hugging Face GPT-2 initialises weights from N(0, 0.02).
DUMMY_INIT_STD = 0.02
# On CUDA the LM head's rows are padded to this multiple (see GPT2LMHeadModel.pad_lm_head):
# with GPT-2's odd 50257 output columns cuBLAS falls back to an unaligned kernel, the
# largest single cost of a large decode step in benchmarks/profile_decode.py's H100 profile.
CUDA_LM_HEAD_ROW_MULTIPLE = 64
# Checkpoint entries that are buffers of older transformers versions, not weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


@dataclass
class LoadedModel:
    model: GPT2LMHeadModel
    eos_token_ids: list[int]  # the first is model.config.eos_token_id


def load_model(
    model: str,
    load_format: str,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    quantization: str | None = None,
) -> LoadedModel:
    """The model on `device` in `dtype`; on a CPU its linear layers are then prepared for
    the CPU's kernels (linear.py): int8 with `quantization` "int8", else oneDNN-packed
    where `can_pack(dtype)`."""
    path, config = model_config(model, load_format)
    eos = eos_token_ids(path, config)
    config = replace(config, eos_token_id=eos[0] if eos else None)

    with torch.device("meta"):
        net = MODELS[config.model_type](config, backend)
    _materialize(net, device)
    if load_format == "dummy":
        _init_dummy(net, seed)
    else:
        assert path is not None  # only dummy presets have no folder
        _load_safetensors(net, path, config)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.wte.weight  # _materialize re-creates parameters: tie again
    net = net.to(dtype).eval()
    if device.type == "cuda":
        net.pad_lm_head(CUDA_LM_HEAD_ROW_MULTIPLE)
    elif quantization == "int8":
        replace_linears(net, Int8Linear)
    elif can_pack(dtype):
        replace_linears(net, PackedLinear)
    return LoadedModel(net, eos)


def _materialize(net: torch.nn.Module, device: torch.device) -> None:
    """Replaces every parameter of `net` (built on the meta device) by an uninitialized one
    on `device`, for the loader to fill. Not Module.to_empty: its empty_like of a meta tensor
    runs torch's Python reference, which imports sympy, a slow import no engine start needs
    (docs/benchmarks/history.md, "Startup")."""
    for module in net.modules():
        for name, param in module.named_parameters(recurse=False):
            empty = torch.empty(param.shape, dtype=param.dtype, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=param.requires_grad))


def _init_dummy(net: GPT2LMHeadModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif ".ln_" in name or name.startswith("ln_f"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * DUMMY_INIT_STD)


def _load_safetensors(net: GPT2LMHeadModel, path: Path, config: GPT2Config) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(path.glob("*.bin")):
            raise ValueError(f"{path}: only pickle (.bin) weights found; convert to safetensors")
        raise ValueError(f"{path}: no .safetensors weights found")
    checkpoint: dict[str, torch.Tensor] = {}
    for file in files:
        for key, tensor in load_file(str(file)).items():
            checkpoint[key.removeprefix("transformer.")] = tensor
    params = dict(net.named_parameters(remove_duplicate=False))
    if config.tie_word_embeddings:
        params.pop("lm_head.weight")
    unexpected = sorted(
        k
        for k in checkpoint
        if k not in params and not k.endswith(_IGNORED_SUFFIXES) and k != "lm_head.weight"
    )
    missing = sorted(k for k in params if k not in checkpoint)
    if unexpected or missing:
        raise ValueError(
            f"{path}: checkpoint does not match {config.model_type}: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )
    with torch.no_grad():
        for name, param in params.items():
            tensor = checkpoint[name]
            if name.endswith(net.conv1d_weights):
                tensor = tensor.t()
            if tensor.shape != param.shape:
                raise ValueError(
                    f"{path}: {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            param.copy_(tensor)
