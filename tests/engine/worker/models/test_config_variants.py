"""GPT-2 config variants against transformers: every MLP activation of HF's ACT2FN that has no
weights, scale_attn_weights=False, scale_attn_by_inverse_layer_idx and reorder_and_upcast_attn,
alone and combined: logits, greedy and beam search through the engine, the Triton kernels; and
the flags still refused.

Every variant shares one set of random weights (only config.json differs), large enough that
any two variants that compute different functions give logits apart by many times the
tolerance (checked, as a precondition, by test_the_weights_tell_the_variants_apart).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from octavo import kernels
from octavo.engine import BeamSearchParams, EngineConfig, LLMEngine, SamplingParams
from octavo.engine.worker.attention.backend import AttentionMetadata
from octavo.engine.worker.attention.torch_backend import TorchAttentionBackend
from octavo.engine.worker.models.configs import ACTIVATION_FUNCTIONS, GPT2Config
from octavo.engine.worker.models.gpt2 import ACTIVATIONS
from octavo.engine.worker.models.weights import load_model
from octavo.kernels.paged_attention import paged_attention, paged_attention_ref
from tests.checkpoints import TinySpec, make_checkpoint, sample_prompts
from tests.engine.helpers import hf_greedy, run_to_completion
from tests.engine.test_beam_search import hf_beam_search
from tests.engine.worker.models.test_gpt2_parity import paged_logits
from tests.kernels.paged_setup import PagedBatch, make_batch

SPEC = TinySpec(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=128, seed=4)
ATTENTION_VARIANTS = {
    "scale_attn_by_inverse_layer_idx": {"scale_attn_by_inverse_layer_idx": True},
    "reorder_and_upcast_attn": {"reorder_and_upcast_attn": True},
    "no_scale_attn_weights": {"scale_attn_weights": False},
    "combined": {
        "activation_function": "quick_gelu",
        "scale_attn_weights": False,
        "scale_attn_by_inverse_layer_idx": True,
        "reorder_and_upcast_attn": True,
    },
}
VARIANTS = {f"act_{name}": {"activation_function": name} for name in ACTIVATIONS}
VARIANTS |= ATTENTION_VARIANTS
# c_fc's weights are scaled by this after HF's init: its outputs then reach past +-10, where
# gelu_10 clips, and spread over the range where the GELU approximations differ most.
MLP_INPUT_GAIN = 2.5
# The logits' tolerance against HF in float32, as test_gpt2_parity's.
ATOL = 1e-4
MAX_TOKENS = 10
# Room for the longest prompt (40) and its tokens, in 16 blocks of 4.
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    folder = Path(make_checkpoint(tmp_path_factory.mktemp("variants-base"), SPEC))
    weights = load_file(folder / "model.safetensors")
    for name in weights:
        if name.endswith("mlp.c_fc.weight"):
            weights[name] = weights[name] * MLP_INPUT_GAIN
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def variant_dir(base: Path, folder: Path, overrides: dict) -> str:
    """A copy of checkpoint `base` with `overrides` written into its config.json."""
    shutil.copytree(base, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text()) | overrides
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def variants(base_dir, tmp_path_factory):
    """name -> (checkpoint folder, HF model on its eager attention path, the one that
    implements reorder_and_upcast_attn), built on first use."""
    from transformers import GPT2LMHeadModel

    built: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(name: str) -> tuple[str, torch.nn.Module]:
        if name not in built:
            folder = variant_dir(base_dir, tmp_path_factory.mktemp(name), VARIANTS[name])
            hf = GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
            built[name] = folder, hf
        return built[name]

    return get


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return sample_prompts(6, 1, 40, SPEC.vocab_size, seed=3)


LOGITS_TOKENS = sample_prompts(1, 45, 45, SPEC.vocab_size, seed=1)[0]


@pytest.fixture(scope="module")
def hf_logits(variants):
    """name -> HF's logits of LOGITS_TOKENS, computed on first use."""
    computed: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if name not in computed:
            with torch.no_grad():
                computed[name] = variants(name)[1](torch.tensor([LOGITS_TOKENS])).logits[0]
        return computed[name]

    return get


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(variants, hf_logits, name):
    ours = load_model(
        variants(name)[0], "auto", TorchAttentionBackend(), torch.device("cpu"), torch.float32, 0
    ).model
    expected = hf_logits(name)
    for chunks in ([45], [7, 1, 30, 7]):
        got = paged_logits(ours, LOGITS_TOKENS, chunks, block_size=4)
        assert torch.allclose(got, expected, atol=ATOL, rtol=0), (
            chunks,
            (got - expected).abs().max(),
        )


def test_the_weights_tell_the_variants_apart(hf_logits):
    """A precondition of the parity tests: two variants that compute different functions
    (HF names of one formula share an entry of ACTIVATIONS; reorder_and_upcast_attn changes
    nothing in float32) give logits further apart than 5x the tolerance."""

    def function(name: str) -> tuple:
        overrides = VARIANTS[name]
        return (
            id(ACTIVATIONS[overrides.get("activation_function", "gelu_new")]),
            overrides.get("scale_attn_weights", True),
            overrides.get("scale_attn_by_inverse_layer_idx", False),
        )

    names = list(VARIANTS)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if function(a) != function(b):
                gap = (hf_logits(a) - hf_logits(b)).abs().max().item()
                assert gap > 5 * ATOL, (a, b, gap)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_with_chunked_prefill_and_preemption_equals_transformers(variants, prompts, name):
    folder, hf = variants(name)
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    # 20 usable blocks of 4: the longest request (50 tokens, 13 blocks) fits, all six do
    # not; prompts of up to 40 tokens are prefilled in chunks of at most 16.
    engine = LLMEngine(
        EngineConfig(
            model=folder,
            device="cpu",
            dtype="float32",
            num_blocks=21,
            block_size=4,
            max_num_batched_tokens=16,
            max_model_len=MAX_MODEL_LEN,
        )
    )
    outputs = run_to_completion(
        engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    )
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert engine.stats().num_preemptions > 0


BEAM_CASES = [
    BeamSearchParams(beam_width=2, max_tokens=8),
    BeamSearchParams(beam_width=3, max_tokens=6, num_return_sequences=2, length_penalty=0.5),
    BeamSearchParams(beam_width=4, max_tokens=7, num_return_sequences=3, early_stopping=True),
    BeamSearchParams(beam_width=2, max_tokens=8, length_penalty=2.0, early_stopping="never"),
    BeamSearchParams(beam_width=3, max_tokens=8, num_return_sequences=3),
]

# Room for the short prompts (5-20 tokens) of the beam and Triton tests and their tokens.
SHORT_MAX_MODEL_LEN = 32


@pytest.mark.parametrize("name", list(ATTENTION_VARIANTS))
def test_beam_search_equals_transformers(variants, name):
    assert_beam_search_equals_transformers(*variants(name), SPEC.vocab_size)


def assert_beam_search_equals_transformers(folder: str, hf, vocab_size: int) -> None:
    """BEAM_CASES through the engine equal HF's beam search, sequences and scores, in a pool
    of 28 usable blocks of 4: each group fits alone, the five together do not, so beams
    fork copy-on-write and groups are preempted."""
    beam_prompts = sample_prompts(len(BEAM_CASES), 5, 20, vocab_size, seed=9)
    cases = list(zip(beam_prompts, BEAM_CASES, strict=True))
    expected = [hf_beam_search(hf, prompt, params) for prompt, params in cases]
    engine = LLMEngine(
        EngineConfig(
            model=folder,
            device="cpu",
            dtype="float32",
            num_blocks=29,
            block_size=4,
            max_model_len=SHORT_MAX_MODEL_LEN,
        )
    )
    outputs = run_to_completion(engine, [c[0] for c in cases], [c[1] for c in cases])
    for output, (sequences, scores) in zip(outputs, expected, strict=True):
        assert [o.token_ids for o in output.outputs] == sequences
        assert [o.score for o in output.outputs] == pytest.approx(scores, abs=1e-4)
    assert engine.stats().num_preemptions > 0


def test_triton_backend_greedy_equals_transformers(variants, pytestconfig):
    """The kernels take each layer's scale from the model: all attention flags at once."""
    if not kernels.interpreter_active() and pytestconfig.getoption("--engine-device") is None:
        pytest.skip("Triton kernels on CPU need the interpreter; use --engine-device cuda")
    folder, hf = variants("combined")
    # Short prompts, few steps: every kernel launch is interpreted (~ms per op).
    short = sample_prompts(3, 2, 20, SPEC.vocab_size, seed=8)
    expected = [hf_greedy(hf, p, 5) for p in short]
    engine = LLMEngine(
        EngineConfig(
            model=folder,
            device="cpu",
            dtype="float32",
            num_blocks=16,
            block_size=4,
            max_num_batched_tokens=12,
            max_model_len=SHORT_MAX_MODEL_LEN,
            attention_backend="triton",
        )
    )
    outputs = run_to_completion(engine, short, SamplingParams(temperature=0, max_tokens=5))
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("add_cross_attention", True),
        ("model_type", "llama"),
        ("activation_function", "prelu"),  # HF's has a learned slope: weights we do not load
        ("activation_function", "xielu"),
        ("activation_function", "gelu_tanh"),
    ],
)
def test_unsupported_flags_are_refused_by_name(base_dir, tmp_path, field, value):
    folder = variant_dir(base_dir, tmp_path, {field: value})
    with pytest.raises(ValueError, match=field) as refused:
        load_model(folder, "auto", TorchAttentionBackend(), torch.device("cpu"), torch.float32, 0)
    if field == "activation_function":
        assert "gelu_new" in str(refused.value), "the message lists the supported names"


def test_every_weightless_transformers_activation_is_supported_and_equal():
    """Each ACT2FN name: one without parameters or buffers computes HF's function (to float32
    rounding); one with them (learned weights) is refused."""
    from transformers.activations import ACT2CLS, ACT2FN

    x = torch.cat([torch.linspace(-30, 30, 6001), torch.randn(4000) * 3])
    refused = []
    for name in ACT2CLS:
        theirs = ACT2FN[name]
        if theirs.state_dict():
            refused.append(name)
            with pytest.raises(ValueError, match="activation_function"):
                GPT2Config(activation_function=name)
            continue
        torch.testing.assert_close(ACTIVATIONS[name](x), theirs(x), atol=1e-6, rtol=1e-6)
    assert refused, "a precondition: some HF activation has weights"
    assert set(ACTIVATIONS) <= set(ACT2CLS)
    # The configuration (torch-free) accepts exactly the activations the model computes.
    assert set(ACTIVATION_FUNCTIONS) == set(ACTIVATIONS)


@pytest.mark.parametrize("scale_attn_weights", [True, False])
@pytest.mark.parametrize("inverse_layer_idx", [True, False])
def test_attention_scale_is_transformers_scaling(scale_attn_weights, inverse_layer_idx):
    from transformers import GPT2Config as HFConfig
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    flags = {
        "scale_attn_weights": scale_attn_weights,
        "scale_attn_by_inverse_layer_idx": inverse_layer_idx,
    }
    hf_config = HFConfig(n_embd=48, n_head=2, n_layer=3, **flags)
    ours = GPT2Config.from_hf_dict(hf_config.to_dict())
    for layer in range(3):
        assert ours.attention_scale(layer) == GPT2Attention(hf_config, layer_idx=layer).scaling


def overflowing_fp16_batch(query_lens: list[int], seq_lens: list[int]) -> PagedBatch:
    """fp16 queries and keys whose dot products exceed fp16's range (~65504) while the scaled
    scores stay moderate: only scores computed in float32 come out right."""
    batch = make_batch(
        query_lens, seq_lens, num_heads=2, head_dim=32, block_size=4, dtype=torch.float16
    )
    batch.q.mul_(120)
    batch.k_cache.mul_(120)
    batch.scale = 1e-4
    products = torch.einsum("thd,bshd->thbs", batch.q.float(), batch.k_cache.nan_to_num(0).float())
    assert products.abs().max() > torch.finfo(torch.float16).max  # a precondition
    return batch


CASES = {"decode": ([1, 1], [9, 20]), "prefill_with_context": ([7, 12], [20, 30])}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_backends_compute_scores_in_float32(backend, case):
    """What reorder_and_upcast_attn asks of HF's attention holds for both backends at any
    dtype: QK^T and the softmax in float32 (fp16 inputs here; fp16 scores would overflow)."""
    if backend == "triton" and not kernels.interpreter_active():
        pytest.skip("Triton kernels on CPU need the interpreter")
    batch = overflowing_fp16_batch(*CASES[case])
    expected = paged_attention_ref(*batch.args(), torch.empty_like(batch.q), batch.scale)
    if backend == "triton":
        got = paged_attention(*batch.args(), torch.empty_like(batch.q), batch.scale)
    else:
        got = torch_backend_attention(batch)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1e-2)


def torch_backend_attention(batch: PagedBatch) -> torch.Tensor:
    """The torch backend over `batch`: its queries' own keys and values are taken from the
    cache and stored back into the same slots."""
    block_size = batch.k_cache.shape[1]
    seq_lens, cu = batch.seq_lens.tolist(), batch.cu_seqlens_q.tolist()
    slots = []
    for s, seq_len in enumerate(seq_lens):
        for pos in range(seq_len - (cu[s + 1] - cu[s]), seq_len):
            slots.append(
                int(batch.block_tables[s, pos // block_size]) * block_size + pos % block_size
            )
    slot_mapping = torch.tensor(slots)
    kv_cache = torch.stack([batch.k_cache, batch.v_cache])
    k = kv_cache[0].flatten(0, 1)[slot_mapping]
    v = kv_cache[1].flatten(0, 1)[slot_mapping]
    query_lens = [b - a for a, b in zip(cu, cu[1:], strict=False)]
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        cu_seqlens_q=batch.cu_seqlens_q,
        max_seqlen_q=batch.max_seqlen_q,
        max_seqlen_k=batch.max_seqlen_k,
        block_size=block_size,
        seq_lens_host=seq_lens,
        query_lens_host=query_lens,
        num_decodes=next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens)),
    )
    backend = TorchAttentionBackend()
    return backend.forward(batch.q, k, v, kv_cache, backend.prepare(metadata), batch.scale)
