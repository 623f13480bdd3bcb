"""A multi-query GPTBigCode checkpoint served by the app, through the official openai client:
its greedy text, streamed and not, is transformers' greedy continuation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.checkpoints import TinySpec, make_gpt_bigcode_checkpoint
from tests.engine.helpers import hf_greedy
from tests.server.conftest import MODEL_NAME
from tests.server.inprocess.conftest import InProcessServer

SPEC = TinySpec(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=128, seed=6)
PROMPT = "The return statement"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[InProcessServer, str]]:
    """The app over the checkpoint, and transformers' greedy text for PROMPT."""
    from tokenizers import Tokenizer
    from transformers import GPTBigCodeForCausalLM

    folder = tmp_path_factory.mktemp("gpt_bigcode")
    make_gpt_bigcode_checkpoint(folder, SPEC, multi_query=True)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf = GPTBigCodeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos: always MAX_TOKENS tokens
    tokens = hf_greedy(hf, tokenizer.encode(PROMPT).ids, MAX_TOKENS)
    server = InProcessServer(str(folder))
    try:
        yield server, tokenizer.decode(tokens)
    finally:
        server.close()


def test_completions_are_transformers_greedy_text(served):
    server, expected = served
    client = server.openai()
    request = {
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    full = client.completions.create(**request)
    assert full.choices[0].text == expected
    assert full.usage.completion_tokens == MAX_TOKENS
    chunks = list(client.completions.create(**request, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
