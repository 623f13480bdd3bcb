"""The engine on a GPU: triton kernels + CUDA graphs give HF's greedy tokens; fp16 runs."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.checkpoints import sample_prompts
from tests.engine.helpers import hf_greedy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_greedy_on_gpu_equals_hf(tiny_model_dir, hf_tiny, enforce_eager):
    llm = LLM(
        model=tiny_model_dir,
        device="cuda",
        dtype="float32",
        num_blocks=2048,
        max_num_seqs=16,
        enforce_eager=enforce_eager,
    )
    assert llm.engine.runner.backend.name == "triton"
    assert (llm.engine.runner.graphs is None) == enforce_eager
    prompts = sample_prompts(12, 1, 120, hf_tiny.config.vocab_size, seed=0)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_tiny, prompt, 24)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_runs_and_sizes_the_cache_from_memory(tiny_model_dir, dtype):
    llm = LLM(
        model=tiny_model_dir, device="cuda", dtype=dtype, gpu_memory_utilization=0.5, max_num_seqs=8
    )
    free, total = torch.cuda.mem_get_info()
    assert llm.engine.block_manager.num_blocks > 1000
    assert free < total * 0.6  # the cache took about half of the device
    outputs = llm.generate(
        ["The class", "A list"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outputs)
