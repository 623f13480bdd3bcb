"""The embedded default model: loadable by transformers, served when no --model is given."""

import json
import math

import httpx
import pytest
import tokenizers
import torch
from safetensors import safe_open

from octavo.engine import LLM, SamplingParams
from octavo.server.chat_template import ChatTemplate
from octavo.server.server_args import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from tests.server.conftest import live_server

PROMPTS = ["The for statement", "A class definition", "Exceptions are"]


def gpt2_parameters(config: dict) -> int:
    """GPT-2's parameter count from its config (lm_head tied to wte, MLP 4x wide)."""
    d, layers = config["n_embd"], config["n_layer"]
    per_layer = 12 * d * d + 13 * d  # attention 4d^2 + 4d, MLP 8d^2 + 5d, two LayerNorms 4d
    return (config["vocab_size"] + config["n_positions"]) * d + layers * per_layer + 2 * d


def test_default_model_files_agree_and_the_weights_are_small():
    """The embedded model is what training.json says was trained, its tokenizer covers the
    vocabulary, and the wheel carries 1-5 M float16 parameters, nothing else."""
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    trained = json.loads((DEFAULT_MODEL / "training.json").read_text())
    assert config["model_type"] == "gpt2"
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        assert config[key] == trained[key], key
    tokenizer = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    assert tokenizer.id_to_token(config["eos_token_id"]) is not None
    weights = DEFAULT_MODEL / "model.safetensors"
    with safe_open(weights, "pt") as f:
        names = f.keys()
        shapes = {name: f.get_slice(name).get_shape() for name in names}
        dtypes = {f.get_slice(name).get_dtype() for name in names}
    count = sum(math.prod(shape) for shape in shapes.values())
    assert count == gpt2_parameters(config) and 1e6 <= count <= 5e6
    assert dtypes == {"F16"}
    header = weights.stat().st_size - 2 * count  # safetensors: a JSON header, then the data
    assert 0 < header < 16 << 10


def test_default_model_greedy_equals_transformers():
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
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


@pytest.mark.slow
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


def test_the_chat_template_renders_as_transformers_renders_it():
    """The embedded model's template (tools/chat_template.jinja, which training writes into
    its tokenizer_config.json) gives transformers' apply_chat_template text: a system turn
    with the tools, calls as Hermes blocks the hermes parser reads back, a tool's result."""
    from transformers import PreTrainedTokenizerFast

    from octavo.server.tool_calls import HermesCalls
    from tools.train_default_model import TEMPLATE

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Returns the weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }}]  # fmt: skip
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}  # fmt: skip
    messages = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is the weather in Lima?"},
        {"role": "assistant", "content": None, "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL / "tokenizer.json"))
    hf.chat_template = TEMPLATE.read_text()
    ours = ChatTemplate(TEMPLATE.read_text(), "<|endoftext|>", "<|im_end|>")
    for given, kwargs in ((messages, {"tools": tools}), (messages[1:2], {})):
        want = hf.apply_chat_template(given, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.render(given, True, **kwargs) == want
    rendered = ours.render(messages, True, tools=tools)
    assert rendered.endswith("<|im_start|>assistant\n")
    turn = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = HermesCalls().parse(turn)
    assert (
        content == "\n"
        and [(c.function.name, c.function.arguments) for c in calls]
        == [("get_weather", '{"city": "Lima"}')] * 2
    )


def test_the_copy_probe_marks_the_spans_and_counts_a_span_right_only_when_every_token_is():
    """tools/chat_eval's teacher-forced copy figure: its spans are the call's name, the
    arguments' values and the answer's quote of the result; a model whose argmax at each
    position is the next token copies all of them, one a token off copies none."""
    from types import SimpleNamespace

    from tools.chat_eval import copied, copy_cases
    from tools.train_default_model import chat_template, corpus, split_corpus

    tokenizer = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    _, texts, _ = split_corpus(corpus(), 0.05)
    cases = copy_cases(chat_template(), tokenizer, texts, count=12)
    for case in cases:
        assert set(case.spans) <= {"tool_name", "argument_values", "result_quotes"}
        assert case.spans["tool_name"] and case.spans["argument_values"]
        for spans in case.spans.values():
            for text, positions in spans:
                spelt = tokenizer.decode([case.ids[i] for i in positions])
                assert positions == list(range(positions[0], positions[-1] + 1))
                assert text in spelt and len(spelt) <= len(text) + 2, (text, spelt)
                assert text not in tokenizer.decode([case.ids[i] for i in positions[1:]])
    assert sum("result_quotes" in case.spans for case in cases) > len(cases) // 2

    class Oracle(torch.nn.Module):
        def __init__(self, shift: int):
            super().__init__()
            self.shift = shift

        def forward(self, input_ids):
            following = torch.roll(input_ids[0], -1) + self.shift
            logits = torch.nn.functional.one_hot(following % 4096, 4096).float()
            return SimpleNamespace(logits=logits[None])

    assert set(copied(Oracle(0), cases).values()) == {1.0}
    assert set(copied(Oracle(1), cases).values()) == {0.0}
