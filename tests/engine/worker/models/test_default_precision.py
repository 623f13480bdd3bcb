"""The default dtype: bfloat16 on a CPU that computes it (float32 elsewhere), float16 on CUDA;
what bfloat16 keeps of float32's greedy tokens on the embedded model, against Hugging Face's
own bfloat16; bfloat16 where the CPU lacks it warns."""

import pytest
import tokenizers
import torch
from transformers import AutoModelForCausalLM

from octavo.engine import LLM, EngineConfig, SamplingParams
from octavo.engine.config import cpu_computes_bfloat16
from octavo.server.server_args import DEFAULT_MODEL
from tests.engine.helpers import hf_greedy

MAX_TOKENS = 32
TEXTS = [
    "The history of the city begins",
    "Once upon a time, a small robot",
    "In the morning the market was",
    "Scientists announced on Tuesday that",
    "The recipe calls for two cups of",
    "After the match, the players",
]


def test_auto_resolves_by_device_and_cpu():
    expected = torch.bfloat16 if cpu_computes_bfloat16() else torch.float32
    assert EngineConfig(model="m", device="cpu").torch_dtype == expected
    assert EngineConfig(model="m", device="cuda").torch_dtype == torch.float16
    assert EngineConfig(model="m", device="cpu", dtype="bfloat16").torch_dtype == torch.bfloat16


def _agreement(tokens: list[list[int]], reference: list[list[int]]) -> int:
    """Tokens in common with the reference, from the start of each continuation."""
    total = 0
    for got, want in zip(tokens, reference, strict=True):
        for a, b in zip(got, want, strict=False):
            if a != b:
                break
            total += 1
    return total


@pytest.mark.skipif(not cpu_computes_bfloat16(), reason="this CPU emulates bfloat16")
def test_the_default_keeps_float32s_greedy_tokens_as_long_as_hf_bfloat16(caplog):
    tokenizer = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    prompts = [tokenizer.encode(text).ids for text in TEXTS]
    hf32 = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.bfloat16).eval()
    reference = [hf_greedy(hf32, p, MAX_TOKENS) for p in prompts]
    hf_bfloat16 = [hf_greedy(hf16, p, MAX_TOKENS) for p in prompts]
    llm = LLM(str(DEFAULT_MODEL), device="cpu", kv_cache_gb=0.0625)  # the default
    assert next(llm.engine.core.runner.model.parameters()).dtype == torch.bfloat16
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    ours = [o.outputs[0].token_ids for o in outputs]
    assert _agreement(ours, reference) >= _agreement(hf_bfloat16, reference)
    assert "emulated" not in caplog.text  # this CPU computes bfloat16: no warning


def test_bfloat16_where_the_cpu_lacks_it_warns_what_it_costs(monkeypatch, caplog):
    monkeypatch.setattr("octavo.engine.worker.worker.cpu_computes_bfloat16", lambda: False)
    LLM(str(DEFAULT_MODEL), device="cpu", dtype="bfloat16", kv_cache_gb=0.0625)
    assert "slower than in float32" in caplog.text
