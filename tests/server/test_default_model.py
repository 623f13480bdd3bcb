"""The embedded default model: loadable by transformers, served when no --model is given."""

import json

import httpx
import torch

from octavo.engine import LLM, SamplingParams
from octavo.server.cli import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from tests.server.conftest import live_server

PROMPTS = ["The for statement", "A class definition", "Exceptions are"]


def test_default_model_files_and_size():
    names = {p.name for p in DEFAULT_MODEL.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert config["model_type"] == "gpt2"


def test_default_model_greedy_equals_transformers():
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    assert 1e6 <= sum(p.numel() for p in hf.parameters()) <= 5e6
    llm = LLM(model=str(DEFAULT_MODEL), dtype="float32", device="cpu", num_blocks=256)
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=24,
                do_sample=False,
                pad_token_id=hf.config.eos_token_id,
            )[0, len(ids) :].tolist()
        assert output.outputs[0].token_ids == expected
        # A trained model writes mostly words, not byte soup.
        assert sum(c.isalpha() or c.isspace() for c in output.outputs[0].text) > 0.6 * len(
            output.outputs[0].text
        )


def test_serve_without_model_serves_the_default(tmp_path):
    with live_server(None, tmp_path) as server:
        models = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL_NAME]
        body = {
            "model": DEFAULT_MODEL_NAME,
            "prompt": PROMPTS[0],
            "max_tokens": 8,
            "temperature": 0,
        }
        out = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).json()
        assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] > 0
