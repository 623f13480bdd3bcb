"""Shared fixtures: tiny GPT-2 checkpoints (with a real byte-level BPE tokenizer) and the HF oracle."""

import os

import torch

# The Triton interpreter must be chosen before any @triton.jit decorator runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.checkpoints import TinySpec, make_checkpoint  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A 2-layer, 64-wide GPT-2 with a 512-token BPE vocabulary; EOS is token 0."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), TinySpec())


@pytest.fixture(scope="session")
def hf_tiny(tiny_model_dir):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(tiny_model_dir).eval()
