"""The whole engine on the Triton kernels (interpreter on CPU) gives the torch backend's tokens."""

import pytest

from octavo import kernels
from octavo.engine import BeamSearchParams, EngineConfig, LLMEngine, SamplingParams
from tests.checkpoints import sample_prompts
from tests.engine.helpers import run_to_completion


def engine(model_dir: str, backend: str, **overrides) -> LLMEngine:
    config = {
        "model": model_dir,
        "device": "cpu",
        "dtype": "float32",
        "num_blocks": 128,
        "block_size": 8,
        "max_num_batched_tokens": 24,
        "attention_backend": backend,
    } | overrides
    return LLMEngine(EngineConfig(**config))


@pytest.fixture(autouse=True)
def _kernels_can_run(pytestconfig):
    """Off the interpreter (a CUDA machine, where the kernels compile for the GPU) these CPU
    engines cannot run the kernels: the tests run there with --engine-device cuda only."""
    if not kernels.interpreter_active() and pytestconfig.getoption("--engine-device") is None:
        pytest.skip("Triton kernels on CPU need the interpreter; use --engine-device cuda")


def test_triton_backend_matches_torch_backend(tiny_model_dir, hf_tiny):
    # Short prompts, few steps: every kernel launch is interpreted (~ms per op).
    prompts = sample_prompts(4, 1, 30, hf_tiny.config.vocab_size, seed=7)
    # logprobs=0: the cumulative logprob is reported (and compared) without alternatives.
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    expected = run_to_completion(engine(tiny_model_dir, "torch"), prompts, greedy)
    got = run_to_completion(engine(tiny_model_dir, "triton"), prompts, greedy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    for a, b in zip(got, expected, strict=True):
        assert a.outputs[0].cumulative_logprob == pytest.approx(
            b.outputs[0].cumulative_logprob, abs=1e-4
        )


def test_triton_backend_copy_on_write_through_beam_forks(tiny_model_dir):
    """Beams fork partial blocks: the copy_blocks kernel must run before store_kv."""
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 9, 10]]  # 6 tokens: a partial last block of 8
    expected = run_to_completion(engine(tiny_model_dir, "torch"), prompt, params)
    got = run_to_completion(engine(tiny_model_dir, "triton"), prompt, params)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
