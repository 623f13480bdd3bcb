"""The engine on a GPU: triton kernels + CUDA graphs give HF's greedy tokens and beams; fp16
runs."""

import gc

import pytest
import torch

from octavo.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.checkpoints import sample_prompts
from tests.engine.helpers import (
    assert_hf_greedy,
    hf_greedy,
    run_to_completion,
    staggered_greedy,
)
from tests.engine.test_beam_search import assert_same, hf_beam_search, make_case

NUM_BEAM_CASES = 60

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
    full = llm.engine.runner.dispatcher.full
    assert (full is None) == enforce_eager
    if full is not None:
        assert set(full.graphs) == set(full.buffers.buckets)
    prompts = sample_prompts(12, 1, 120, hf_tiny.config.vocab_size, seed=0)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_tiny, prompt, 24)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_piecewise_graphs_on_gpu_equal_hf(tiny_model_dir, hf_tiny, async_scheduling):
    """Steps that prefill replay captured pieces around eager attention: prompts of many
    lengths, three running at a time and a small step budget, so chunks of new prompts
    run beside decodes at token counts padded to a bucket."""
    llm = LLM(
        model=tiny_model_dir, device="cuda", dtype="float32", num_blocks=2048, max_num_seqs=3,
        max_num_batched_tokens=48, piecewise_cuda_graphs=True, async_scheduling=async_scheduling,
    )  # fmt: skip
    piecewise = llm.engine.runner.dispatcher.piecewise
    assert piecewise is not None
    assert set(piecewise.graphs) == set(piecewise.buckets)
    prompts = sample_prompts(8, 5, 120, hf_tiny.config.vocab_size, seed=7)
    params = staggered_greedy(8, first=4, step=3)
    assert_hf_greedy(hf_tiny, prompts, params, llm.generate(prompts, params, use_tqdm=False))


@pytest.mark.gpu_memory
def test_half_precision_runs_and_sizes_the_cache_from_memory(tiny_model_dir):
    """Each half dtype in turn, in one test: the budget is a share of the whole device, so two
    engines taking half of it each (two test workers at once) cannot both start."""
    for dtype in ("float16", "bfloat16"):
        llm = LLM(
            model=tiny_model_dir,
            device="cuda",
            dtype=dtype,
            gpu_memory_utilization=0.5,
            max_num_seqs=8,
        )
        free, total = torch.cuda.mem_get_info()
        assert llm.engine.block_manager.num_blocks > 1000
        assert free < total * 0.6  # the cache took about half of the device
        outputs = llm.generate(
            ["The class", "A list"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
        )
        assert all(len(o.outputs[0].token_ids) >= 1 for o in outputs)
        del llm, outputs
        gc.collect()


def test_capture_runs_with_the_collector_off_and_survives_an_abandoned_engine(
    tiny_model_dir, hf_tiny
):
    """An engine dropped in a reference cycle holds CUDA graphs only the collector frees;
    freeing them inside the next engine's capture invalidated that capture. With the
    collector set to run at nearly every allocation, no collection may happen while a
    stream captures, and the new engine still gives HF's greedy tokens."""
    config = {"model": tiny_model_dir, "device": "cuda", "dtype": "float32", "num_blocks": 512}
    abandoned = [LLM(**config, max_num_seqs=8)]
    abandoned.append(abandoned)  # only the cyclic collector can free it now
    del abandoned
    during_capture: list[str] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start" and torch.cuda.is_current_stream_capturing():
            during_capture.append(f"generation {info['generation']}")

    thresholds = gc.get_threshold()
    gc.callbacks.append(record)
    gc.set_threshold(1, 1, 1)
    try:
        llm = LLM(**config, max_num_seqs=16)
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(record)
    assert during_capture == []
    prompts = sample_prompts(4, 1, 40, hf_tiny.config.vocab_size, seed=3)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_tiny, prompt, 12)


@pytest.mark.parametrize("piecewise", [False, True], ids=["decode_graphs", "piecewise"])
def test_beam_search_on_gpu_equals_hf(eos_model_dir, hf_eos, piecewise):
    """Beam candidates are reduced on the device and moved to the host (the core holds no
    device tensors); HF on the CPU is the oracle. Beam steps (forks, beam rows' logits)
    also through piecewise graphs."""
    cases = [make_case(seed, hf_eos.config.vocab_size) for seed in range(NUM_BEAM_CASES)]
    expected = [hf_beam_search(hf_eos, prompt, params) for prompt, params in cases]
    engine = LLMEngine(
        EngineConfig(
            model=eos_model_dir, device="cuda", dtype="float32", num_blocks=4096,
            piecewise_cuda_graphs=piecewise,
        )
    )  # fmt: skip
    outputs = run_to_completion(engine, [p for p, _ in cases], [p for _, p in cases])
    assert_same(outputs, expected, cases)
