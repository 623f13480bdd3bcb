"""Shared fixtures: tiny GPT-2 checkpoints (real byte-level BPE tokenizer) and the HF oracle."""

import os

import torch

# The Triton interpreter must be chosen before any @triton.jit decorator runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.checkpoints import TinySpec, make_checkpoint  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--engine-device",
        default=None,
        help="build every engine that a test puts on the CPU (device 'cpu' or 'auto') on this "
        "device instead, keeping float32 unless the test names a dtype: the CPU engine suite "
        "run as-is on a GPU (`--engine-device cuda`), CUDA graphs, async copies and all",
    )


@pytest.fixture(autouse=True, scope="session")
def _engine_device(pytestconfig):
    device = pytestconfig.getoption("--engine-device")
    if device is None:
        yield
        return
    from octavo.engine.config import EngineConfig

    device_of, dtype_of = EngineConfig.torch_device.fget, EngineConfig.torch_dtype.fget

    def torch_device(config):
        return torch.device(device) if config.device in ("cpu", "auto") else device_of(config)

    def torch_dtype(config):
        moved = config.device in ("cpu", "auto") and config.dtype == "auto"
        return torch.float32 if moved else dtype_of(config)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineConfig, "torch_device", property(torch_device))
        patch.setattr(EngineConfig, "torch_dtype", property(torch_dtype))
        yield


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


@pytest.fixture(scope="session")
def eos_model_dir(tiny_model_dir, hf_tiny, tmp_path_factory) -> str:
    """The tiny model with its EOS moved to the token its greedy continuations emit most, so
    that many generations (and beams) end early on EOS."""
    from tests.checkpoints import sample_prompts, with_eos

    prompts = sample_prompts(8, 2, 60, hf_tiny.config.vocab_size, seed=11)
    counts = torch.zeros(hf_tiny.config.vocab_size, dtype=torch.long)
    with torch.no_grad():
        for prompt in prompts:
            out = hf_tiny.generate(
                torch.tensor([prompt]),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            counts += torch.bincount(out[0, len(prompt) :], minlength=counts.numel())
    return with_eos(tiny_model_dir, tmp_path_factory.mktemp("eos"), int(counts.argmax()))


@pytest.fixture(scope="session")
def hf_eos(eos_model_dir):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(eos_model_dir).eval()
