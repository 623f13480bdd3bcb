"""Builds small Hugging Face-format GPT-2 folders for tests: config, weights and tokenizer.json.

The tokenizer is a byte-level BPE trained on the Python reference text shipped with the
standard library (pydoc_data.topics), so prompts are real English and multi-byte characters
decode as they do with GPT-2's own tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from tools.train_default_model import corpus, train_tokenizer


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 512
    n_positions: int = 256
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5
    # Wider than HF's 0.02 so logits are peaked: greedy paths vary and ties are unlikely.
    initializer_range: float = 0.2
    seed: int = 0


@cache
def tokenizer_json(vocab_size: int) -> str:
    """The default model's tokenizer recipe at another vocabulary size (cached per size)."""
    return train_tokenizer(corpus(), vocab_size).to_str()


def make_checkpoint(folder: Path, spec: TinySpec) -> str:
    """Writes config.json, generation_config.json, model.safetensors and tokenizer.json."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(spec.seed)
    GPT2LMHeadModel(GPT2Config(**_config_fields(spec))).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tokenizer_json(spec.vocab_size))
    return str(folder)


def make_gpt_bigcode_checkpoint(folder: Path, spec: TinySpec, multi_query: bool) -> str:
    """make_checkpoint's files for a GPTBigCodeForCausalLM of `spec`'s shape."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    torch.manual_seed(spec.seed)
    config = GPTBigCodeConfig(**_config_fields(spec), multi_query=multi_query)
    GPTBigCodeForCausalLM(config).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tokenizer_json(spec.vocab_size))
    return str(folder)


def _config_fields(spec: TinySpec) -> dict:
    """The HF config keyword arguments of `spec`, BOS and EOS inside its small vocabulary."""
    return {
        "vocab_size": spec.vocab_size,
        "n_positions": spec.n_positions,
        "n_embd": spec.n_embd,
        "n_layer": spec.n_layer,
        "n_head": spec.n_head,
        "n_inner": spec.n_inner,
        "layer_norm_epsilon": spec.layer_norm_epsilon,
        "initializer_range": spec.initializer_range,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }


def sample_prompts(
    num: int, min_len: int, max_len: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """Random token-id prompts with lengths spread over [min_len, max_len] (ends included)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(min_len, max_len, num).round().long().tolist()
    order = torch.randperm(num, generator=generator).tolist()
    return [
        torch.randint(1, vocab_size, (lengths[i],), generator=generator).tolist() for i in order
    ]


def with_eos(source: str, folder: Path, eos_token_id: int) -> str:
    """A copy of checkpoint `source` whose EOS (config and generation config) is `eos_token_id`."""
    import json
    import shutil

    shutil.copytree(source, folder, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        config = json.loads(path.read_text())
        config["eos_token_id"] = eos_token_id
        path.write_text(json.dumps(config, indent=2))
    return str(folder)
