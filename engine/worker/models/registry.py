"""The model architectures Octavo serves, keyed by config.json's `model_type`.

Every architecture is a GPT2LMHeadModel (its forward and compute_logits contract) with a
config class of configs.py that reads config.json (`config_class.from_hf_dict`) and says how
many K/V heads a layer has (`num_kv_heads`): the KV cache, the kernels and the runner size
and read the cache from that alone.
"""

from __future__ import annotations

from octavo.engine.worker.models.gpt2 import GPT2LMHeadModel
from octavo.engine.worker.models.gpt_bigcode import GPTBigCodeForCausalLM

MODELS: dict[str, type[GPT2LMHeadModel]] = {
    model.config_class.model_type: model for model in (GPT2LMHeadModel, GPTBigCodeForCausalLM)
}
