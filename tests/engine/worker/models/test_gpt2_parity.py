"""Our GPT-2 against transformers.GPT2LMHeadModel: logits through the paged cache; configs."""

import json
import random
from pathlib import Path

import pytest
import torch

from octavo.engine.worker.attention.backend import AttentionMetadata
from octavo.engine.worker.attention.torch_backend import TorchAttentionBackend
from octavo.engine.worker.models.configs import GPT2Config
from octavo.engine.worker.models.model_files import DUMMY_PRESETS
from octavo.engine.worker.models.weights import load_model
from tests.checkpoints import TinySpec, make_checkpoint

SPECS = [
    TinySpec(),
    TinySpec(n_embd=96, n_layer=3, n_head=6, n_inner=200, layer_norm_epsilon=1e-6, seed=1),
    TinySpec(vocab_size=300, n_embd=32, n_layer=1, n_head=2, n_positions=64, seed=2),
    TinySpec(n_embd=128, n_layer=4, n_head=8, initializer_range=0.02, seed=3),
]


def paged_logits(
    model, tokens: list[int], chunks: list[int], block_size: int, backend=None
) -> torch.Tensor:
    """Runs `tokens` through the model (on its device; the torch backend unless another is
    given) in prefill chunks over a shuffled paged cache; returns the logits of every
    position, on the CPU."""
    config = model.config
    device = model.wte.weight.device
    num_blocks = -(-len(tokens) // block_size) + 1
    physical = list(range(1, num_blocks + 1))
    random.Random(0).shuffle(physical)
    cache = torch.full(
        (config.n_layer, 2, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim),
        float("nan"),
        dtype=model.wte.weight.dtype,
        device=device,
    )
    cache[:, :, 0] = 0
    backend = backend or TorchAttentionBackend()
    logits, start = [], 0
    for chunk in chunks:
        end = start + chunk
        slots = [physical[p // block_size] * block_size + p % block_size for p in range(start, end)]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            block_tables=torch.tensor([physical], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor([0, chunk], dtype=torch.int32, device=device),
            max_seqlen_q=chunk,
            max_seqlen_k=end,
            block_size=block_size,
            seq_lens_host=[end],
            query_lens_host=[chunk],
        )
        with torch.inference_mode():
            hidden = model(
                torch.tensor(tokens[start:end], device=device),
                torch.arange(start, end, device=device),
                cache,
                backend.prepare(metadata),
            )
            logits.append(model.compute_logits(hidden).cpu())
        start = end
    return torch.cat(logits)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"L{s.n_layer}-C{s.n_embd}-H{s.n_head}")
def test_logits_match_transformers(tmp_path, spec):
    from transformers import GPT2LMHeadModel

    folder = make_checkpoint(tmp_path, spec)
    hf = GPT2LMHeadModel.from_pretrained(folder).eval()
    ours = load_model(
        folder, "auto", TorchAttentionBackend(), torch.device("cpu"), torch.float32, seed=0
    ).model
    tokens = torch.randint(
        0,
        spec.vocab_size,
        (min(spec.n_positions, 61),),
        generator=torch.Generator().manual_seed(spec.seed),
    ).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    n = len(tokens)
    for chunks in ([n], [5, 1, 1, 20, n - 27], [1] * 3 + [n - 3]):
        got = paged_logits(ours, tokens, chunks, block_size=4)
        assert torch.allclose(got, expected, atol=1e-4, rtol=0), (
            chunks,
            (got - expected).abs().max(),
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("add_cross_attention", True),
        ("activation_function", "prelu"),
        ("model_type", "llama"),
    ],
)
def test_unsupported_config_flags_are_refused_by_name(tmp_path, field, value):
    folder = make_checkpoint(tmp_path, TinySpec(n_layer=1))
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        load_model(folder, "auto", TorchAttentionBackend(), torch.device("cpu"), torch.float32, 0)


def test_pickle_only_checkpoints_are_refused(tmp_path):
    make_checkpoint(tmp_path, TinySpec(n_layer=1))
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        load_model(
            str(tmp_path), "auto", TorchAttentionBackend(), torch.device("cpu"), torch.float32, 0
        )


# What Hugging Face's num_parameters() reports for the released checkpoints (the lm_head is
# tied to wte), an oracle independent of any shape table: a wrong depth, width, vocabulary,
# context or MLP size changes the count. Every released size has 64-wide heads.
RELEASED_PARAMETERS = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}
RELEASED_HEAD_DIM = 64


@pytest.mark.parametrize("name", sorted(RELEASED_PARAMETERS))
def test_dummy_presets_build_the_released_models(name):
    """load_format="dummy" with a preset name builds a model of the released size (built on
    the meta device: no memory, no weights)."""
    with torch.device("meta"):
        model = load_model(
            name, "dummy", TorchAttentionBackend(), torch.device("meta"), torch.float32, 0
        ).model
    assert sum(p.numel() for p in model.parameters()) == RELEASED_PARAMETERS[name]
    assert model.config.head_dim == RELEASED_HEAD_DIM


def test_the_small_preset_is_transformers_default_gpt2():
    from transformers import GPT2Config as HFConfig

    assert DUMMY_PRESETS["gpt2"] == GPT2Config.from_hf_dict(HFConfig().to_dict())


def test_dummy_weights_build_any_config_and_are_seeded(tmp_path):
    spec = TinySpec(n_layer=1)
    folder = make_checkpoint(tmp_path, spec)

    def load(seed: int):
        backend = TorchAttentionBackend()
        return load_model(folder, "dummy", backend, torch.device("cpu"), torch.float32, seed).model

    a, b, c = load(0), load(0), load(1)
    assert torch.equal(a.h[0].attn.c_attn.weight, b.h[0].attn.c_attn.weight)
    assert not torch.equal(a.h[0].attn.c_attn.weight, c.h[0].attn.c_attn.weight)
    assert a.lm_head.weight is a.wte.weight
    assert a.config == GPT2Config.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_padded_lm_head_gives_the_same_logits_without_a_second_copy(tmp_path, tied):
    """pad_lm_head (what CUDA loading applies) changes the logits' layout, not their values;
    the tied embedding stays one tensor."""
    spec = TinySpec(n_layer=1)
    config = json.loads((Path(make_checkpoint(tmp_path, spec)) / "config.json").read_text())
    config |= {"vocab_size": 509, "tie_word_embeddings": tied}  # 509: not a multiple of 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(
        str(tmp_path), "dummy", TorchAttentionBackend(), torch.device("cpu"), torch.float32, 0
    ).model
    hidden = torch.randn(7, spec.n_embd, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.compute_logits(hidden)
        model.pad_lm_head(64)
        got = model.compute_logits(hidden)
    assert model.lm_head_padded.shape == (512, spec.n_embd)
    assert model.lm_head_padded[509:].eq(0).all()
    assert got.shape == expected.shape == (7, 509)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert model.lm_head.weight.data_ptr() == model.lm_head_padded.data_ptr()
    assert (model.wte.weight.data_ptr() == model.lm_head_padded.data_ptr()) == tied
