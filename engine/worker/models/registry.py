"""The model architectures Octavo serves, keyed by config.json's `model_type`.

Every architecture is a GPT2LMHeadModel (its forward and compute_logits contract) with a
config class that reads config.json (`config_class.from_hf_dict`) and says how many K/V
heads a layer has (`num_kv_heads`): the KV cache, the kernels and the runner size and read
the cache from that alone.
"""

from __future__ import annotations

from typing import Any

from octavo.engine.worker.models.gpt2 import GPT2Config, GPT2LMHeadModel
from octavo.engine.worker.models.gpt_bigcode import GPTBigCodeForCausalLM

MODELS: dict[str, type[GPT2LMHeadModel]] = {
    model.config_class.model_type: model for model in (GPT2LMHeadModel, GPTBigCodeForCausalLM)
}
# What a config.json without `model_type` is taken for (older GPT-2 checkpoints omit it).
DEFAULT_MODEL_TYPE = "gpt2"


def config_from_hf_dict(cfg: dict[str, Any]) -> GPT2Config:
    """The configuration of a config.json, by its model_type; ValueError for an unknown type
    or a flag its architecture does not support."""
    model_type = cfg.get("model_type", DEFAULT_MODEL_TYPE)
    if model_type not in MODELS:
        raise ValueError(
            f"config.json: model_type {model_type!r} is not supported (one of {sorted(MODELS)})"
        )
    return MODELS[model_type].config_class.from_hf_dict(cfg)


def model_class(config: GPT2Config) -> type[GPT2LMHeadModel]:
    """The architecture that runs `config`."""
    return MODELS[config.model_type]
