"""Our GPT-2 on a GPU, Triton kernels and fused layer ops (add + LayerNorm, the GELU in the
matrix product's epilogue) included, against transformers on the CPU."""

import pytest
import torch

from octavo.engine.worker.attention.triton_backend import TritonAttentionBackend
from octavo.engine.worker.models.gpt2 import GPT2MLP, GPT2Config
from octavo.engine.worker.models.weights import load_model
from tests.checkpoints import make_checkpoint
from tests.model.test_gpt2_parity import SPECS, paged_logits

pytestmark = pytest.mark.gpu

# float32 on both sides (TF32 is off for matrix products by default): rounding only. The
# erf GELU in place of GPT-2's tanh one moves the logits by more.
FLOAT32_ATOL = 1e-4
# float16: relative to the logits' spread.
FLOAT16_RTOL = 2e-2
# One MLP in float32 at GPT-2 small's width: the tanh GELU lands within ~2e-6 of HF's, the
# erf GELU 1.2e-4 to 1.8e-4 away (measured on the CPU at 1-256 rows).
MLP_ATOL = 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"L{s.n_layer}-C{s.n_embd}-H{s.n_head}")
def test_logits_on_gpu_match_transformers(tmp_path, spec, dtype):
    from transformers import GPT2LMHeadModel

    folder = make_checkpoint(tmp_path, spec)
    hf = GPT2LMHeadModel.from_pretrained(folder).eval()
    backend = TritonAttentionBackend()
    ours = load_model(folder, "auto", backend, torch.device("cuda"), dtype, seed=0).model
    tokens = torch.randint(
        0, spec.vocab_size, (min(spec.n_positions, 61),),
        generator=torch.Generator().manual_seed(spec.seed),
    ).tolist()  # fmt: skip
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    n = len(tokens)
    for chunks in ([n], [5, 1, 1, 20, n - 27], [1] * 3 + [n - 3]):
        got = paged_logits(ours, tokens, chunks, block_size=16, backend=backend).float()
        error = (got - expected).abs().max().item()
        if dtype == torch.float32:
            assert error < FLOAT32_ATOL, (chunks, error)
        else:
            assert error < FLOAT16_RTOL * expected.abs().max().item(), (chunks, error)


@pytest.mark.parametrize("rows", [1, 3, 64, 256])
def test_mlp_on_gpu_applies_the_tanh_gelu_at_every_batch_size(rows):
    """The fused c_fc + GELU is GPT-2's tanh GELU for any row count (a decode of one
    sequence included), not the erf GELU."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP as HFMLP

    torch.manual_seed(rows)
    config = GPT2Config(n_embd=768)
    ours = GPT2MLP(config).cuda()
    hf = HFMLP(config.inner_dim, transformers_config(config)).cuda().eval()
    with torch.no_grad():  # HF's Conv1D holds nn.Linear's weight transposed
        hf.c_fc.weight.copy_(ours.c_fc.weight.t())
        hf.c_fc.bias.copy_(ours.c_fc.bias)
        hf.c_proj.weight.copy_(ours.c_proj.weight.t())
        hf.c_proj.bias.copy_(ours.c_proj.bias)
        x = torch.randn(rows, config.n_embd, device="cuda")
        error = (ours(x) - hf(x)).abs().max().item()
    assert error < MLP_ATOL, error


def transformers_config(config):
    from transformers import GPT2Config as HFConfig

    return HFConfig(n_embd=config.n_embd, activation_function="gelu_new", resid_pdrop=0.0)
