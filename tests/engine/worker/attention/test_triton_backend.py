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


def _reads_a_slot_its_launch_writes(call: dict) -> bool:
    """Whether a paged_attention call that stores the step's keys inside its decode launch
    has a decode row that reads a slot another row of the launch writes: programs run in any
    order on a GPU, so the read may come before the write."""
    tables, seq_lens = call["block_tables"], call["seq_lens"].tolist()
    slots = call["slot_mapping"].tolist()
    num_decodes = len(seq_lens) if call["max_seqlen_q"] == 1 else call["num_decodes"]
    block_size = call["k_cache"].shape[1]
    written = {slots[r]: r for r in range(num_decodes)}
    for r in range(num_decodes):
        for position in range(seq_lens[r] - 1):  # its own key comes from `key`
            slot = int(tables[r, position // block_size]) * block_size + position % block_size
            if written.get(slot, r) != r:
                return True
    return False


def test_a_draft_verified_position_by_position_stores_its_keys_before_reading(
    tiny_model_dir, monkeypatch
):
    """N-gram speculation verifies a draft as one decode row per position, each reading the
    keys of the rows before it. Such a step stores every key first and reads the cache, so
    no launch that stores as it reads holds two rows of one sequence; the tokens are the
    torch backend's."""
    from octavo.engine.worker.attention import triton_backend

    calls = []
    attention = triton_backend.paged_attention

    def spy(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, *args, **kw):
        if kw.get("key") is not None:
            calls.append({
                "k_cache": k_cache, "block_tables": block_tables, "seq_lens": seq_lens,
                "max_seqlen_q": max_seqlen_q, "num_decodes": kw["num_decodes"],
                "slot_mapping": kw["slot_mapping"],
            })  # fmt: skip
        return attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q,
                         *args, **kw)  # fmt: skip

    monkeypatch.setattr(triton_backend, "paged_attention", spy)
    prompt = list(range(5, 17)) * 2  # quotes itself: something to look up
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 2}  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    overrides = {"speculative_config": ngram, "async_scheduling": False}
    expected = run_to_completion(engine(tiny_model_dir, "torch", **overrides), [prompt], greedy)
    speculating = engine(tiny_model_dir, "triton", **overrides)
    got = run_to_completion(speculating, [prompt], greedy)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert speculating.stats().num_draft_tokens > 0
    assert calls and not any(_reads_a_slot_its_launch_writes(call) for call in calls)
