"""GPTBigCode against transformers.GPTBigCodeForCausalLM, multi-query (one K/V head shared by
four query heads) and multi-head (its own per-head c_attn layout): logits through the paged
cache, greedy with chunked prefill, preemption and prefix caching, beam search, the Triton
backend; the configuration and what it refuses."""

from __future__ import annotations

import json

import pytest
import torch

from octavo import kernels
from octavo.engine import EngineConfig, LLMEngine, SamplingParams
from octavo.engine.worker.attention.torch_backend import TorchAttentionBackend
from octavo.engine.worker.model_runner import ModelRunner
from octavo.engine.worker.models.configs import GPTBigCodeConfig
from octavo.engine.worker.models.gpt_bigcode import GPTBigCodeForCausalLM
from octavo.engine.worker.models.model_files import DUMMY_PRESETS
from octavo.engine.worker.models.weights import load_model
from tests.checkpoints import TinySpec, make_gpt_bigcode_checkpoint, sample_prompts
from tests.engine.helpers import hf_greedy, run_to_completion
from tests.engine.worker.models.test_config_variants import assert_beam_search_equals_transformers
from tests.engine.worker.models.test_gpt2_parity import paged_logits

# Four query heads: with multi_query they share one K/V head.
SPEC = TinySpec(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=128, seed=5)
ATOL = 1e-4  # the logits' tolerance against HF in float32, as test_gpt2_parity's
MAX_TOKENS = 10
MAX_MODEL_LEN = 64
SHORT_MAX_MODEL_LEN = 32  # the beam and Triton tests' short prompts and their tokens
LOGITS_TOKENS = sample_prompts(1, 45, 45, SPEC.vocab_size, seed=1)[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """multi_query -> (folder, HF model) of a random GPTBigCode checkpoint, built on first
    use and shared by the module's tests."""
    from transformers import GPTBigCodeForCausalLM as HFModel

    built: dict[bool, tuple[str, torch.nn.Module]] = {}

    def get(multi_query: bool) -> tuple[str, torch.nn.Module]:
        if multi_query not in built:
            folder = tmp_path_factory.mktemp(f"gpt_bigcode-multi_query-{multi_query}")
            make_gpt_bigcode_checkpoint(folder, SPEC, multi_query=multi_query)
            built[multi_query] = str(folder), HFModel.from_pretrained(folder).eval()
        return built[multi_query]

    return get


# Both layouts: one K/V head shared by the four query heads, and four (c_attn per head).
both_layouts = pytest.mark.parametrize(
    "multi_query", [True, False], ids=["multi_query", "multi_head"]
)


@both_layouts
def test_logits_match_transformers(checkpoints, multi_query):
    folder, hf = checkpoints(multi_query)
    ours = load_model(
        folder, "auto", TorchAttentionBackend(), torch.device("cpu"), torch.float32, 0
    ).model
    assert isinstance(ours, GPTBigCodeForCausalLM)
    with torch.no_grad():
        expected = hf(torch.tensor([LOGITS_TOKENS])).logits[0]
    # One prefill; chunks with context, one of a single token (the decode path).
    for chunks in ([45], [7, 1, 30, 7]):
        got = paged_logits(ours, LOGITS_TOKENS, chunks, block_size=4)
        error = (got - expected).abs().max()
        assert error <= ATOL, (chunks, error)


@both_layouts
def test_greedy_with_chunked_prefill_preemption_and_prefix_caching(checkpoints, multi_query):
    folder, hf = checkpoints(multi_query)
    prompts = sample_prompts(6, 1, 40, SPEC.vocab_size, seed=3)
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    # 20 usable blocks of 4: the longest request (50 tokens, 13 blocks) fits, all six do
    # not; prompts of up to 40 tokens are prefilled in chunks of at most 16.
    engine = LLMEngine(
        EngineConfig(
            model=folder, device="cpu", dtype="float32", num_blocks=21, block_size=4,
            max_num_batched_tokens=16, max_model_len=MAX_MODEL_LEN,
        )
    )  # fmt: skip
    num_kv_heads = engine.core.model_config.num_kv_heads
    assert engine.core.runner.kv_cache.shape[-2] == num_kv_heads
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = run_to_completion(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert engine.stats().num_preemptions > 0
    # Again: the prompts' full blocks now come from the prefix cache.
    again = run_to_completion(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert engine.stats().num_prefix_cache_hits > 0


@both_layouts
def test_beam_search_equals_transformers(checkpoints, multi_query):
    assert_beam_search_equals_transformers(*checkpoints(multi_query), SPEC.vocab_size)


def test_triton_backend_greedy_equals_transformers(checkpoints, pytestconfig):
    """The grouped-query kernels in the engine (multi-query only: the multi-head layout
    runs GPT-2's ungrouped kernels, which GPT-2's Triton tests cover)."""
    folder, hf = checkpoints(True)
    if not kernels.interpreter_active() and pytestconfig.getoption("--engine-device") is None:
        pytest.skip("Triton kernels on CPU need the interpreter; use --engine-device cuda")
    # Short prompts, few steps: every kernel launch is interpreted (~ms per op).
    prompts = sample_prompts(3, 2, 20, SPEC.vocab_size, seed=8)
    expected = [hf_greedy(hf, p, 5) for p in prompts]
    engine = LLMEngine(
        EngineConfig(
            model=folder, device="cpu", dtype="float32", num_blocks=16, block_size=4,
            max_num_batched_tokens=12,
            max_model_len=SHORT_MAX_MODEL_LEN, attention_backend="triton",
        )
    )  # fmt: skip
    outputs = run_to_completion(engine, prompts, SamplingParams(temperature=0, max_tokens=5))
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_config_is_transformers_config():
    """transformers' default GPTBigCodeConfig is the gpt_bigcode dummy preset (GPT-2
    small's shape, multi-query), and its KV cache holds 1/n_head of GPT-2 small's."""
    from transformers import GPTBigCodeConfig as HFConfig

    ours = GPTBigCodeConfig.from_hf_dict(HFConfig().to_dict())
    assert ours == DUMMY_PRESETS["gpt_bigcode"]
    assert (ours.num_kv_heads, ours.qkv_width) == (1, ours.n_embd + 2 * ours.head_dim)
    multi_head = GPTBigCodeConfig.from_hf_dict(HFConfig(multi_query=False).to_dict())
    assert (multi_head.num_kv_heads, multi_head.qkv_width) == (12, 3 * multi_head.n_embd)
    gpt2_bytes = ModelRunner.kv_bytes_per_block(DUMMY_PRESETS["gpt2"], 16, torch.float16)
    assert ModelRunner.kv_bytes_per_block(ours, 16, torch.float16) * ours.n_head == gpt2_bytes


@pytest.mark.parametrize(
    ("field", "value"),
    [("add_cross_attention", True), ("activation_function", "prelu"), ("model_type", "llama")],
)
def test_unsupported_flags_are_refused_by_name(tmp_path, field, value):
    from transformers import GPTBigCodeConfig as HFConfig

    config = HFConfig(n_embd=32, n_head=4, n_layer=1, vocab_size=64).to_dict() | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        load_model(
            str(tmp_path), "dummy", TorchAttentionBackend(), torch.device("cpu"), torch.float32, 0
        )
