"""Finds a model (a local folder or a Hugging Face hub id) and reads its files: the
configuration (config.json, or a dummy preset's), the EOS tokens and the tokenizer's path.

No torch: the API processes read these too, and only the engine core builds the model
(weights.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from octavo.engine.worker.models.configs import GPT2Config, GPTBigCodeConfig, config_from_hf_dict

# Shapes of the released GPT-2 sizes, for load_format="dummy" without a config.json; and
# transformers' default GPTBigCodeConfig: GPT-2 small's shape with multi-query attention.
DUMMY_PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": GPT2Config(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": GPT2Config(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": GPT2Config(n_layer=48, n_embd=1600, n_head=25),
    "gpt_bigcode": GPTBigCodeConfig(n_layer=12, n_embd=768, n_head=12, multi_query=True),
}
_HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",  # the chat template, if the checkpoint has one
    "*.safetensors",
    "*.safetensors.index.json",
]


def tokenizer_file(model: str, load_format: str) -> Path | None:
    """The model's tokenizer.json, or None (a dummy preset, a folder without one)."""
    if load_format == "dummy" and model in DUMMY_PRESETS:
        return None
    path = resolve_model_path(model) / "tokenizer.json"
    return path if path.is_file() else None


def resolve_model_path(model: str) -> Path:
    """A local folder as is; otherwise a hub id downloaded (or found in the HF cache)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=model, allow_patterns=_HUB_FILES))
    except Exception as exc:  # offline, unknown repo, bad id: all mean "cannot load"
        raise ValueError(
            f"model {model!r} is neither a local folder nor a reachable Hugging Face hub id: {exc}"
        ) from exc


def model_config(model: str, load_format: str) -> tuple[Path | None, GPT2Config]:
    """The model's folder (None for a dummy preset) and its configuration."""
    if load_format == "dummy" and model in DUMMY_PRESETS:
        return None, DUMMY_PRESETS[model]
    path = resolve_model_path(model)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model folder {path} has no config.json")
    return path, config_from_hf_dict(json.loads(config_file.read_text()))


def load_model_config(model: str, load_format: str) -> GPT2Config:
    """The configuration alone, without loading weights."""
    return model_config(model, load_format)[1]


def eos_token_ids(path: Path | None, config: GPT2Config) -> list[int]:
    """The tokens that end a sample as EOS: generation_config.json's `eos_token_id` (what HF
    generate stops on: one id, or a list, as a chat model's end of turn beside its end of
    text), else config.json's. The first is the model's EOS (a grammar's end)."""
    eos: Any = config.eos_token_id
    if path is not None and (path / "generation_config.json").is_file():
        eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id", eos)
    if eos is None:
        return []
    return list(dict.fromkeys(eos)) if isinstance(eos, list) else [eos]
