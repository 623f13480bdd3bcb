"""Our GPT-2 on a GPU, Triton kernels and fused layer ops (add + LayerNorm, the GELU in the
matrix product's epilogue) included, against transformers on the CPU."""

import pytest
import torch

from octavo.engine.worker.attention.triton_backend import TritonAttentionBackend
from octavo.engine.worker.models.configs import GPT2Config
from octavo.engine.worker.models.gpt2 import GPT2MLP
from octavo.engine.worker.models.weights import load_model
from tests.checkpoints import make_checkpoint
from tests.engine.worker.models.test_gpt2_parity import SPECS, paged_logits

pytestmark = pytest.mark.gpu

# float32 on both sides (TF32 is off for matrix products by default): rounding only. The
# erf GELU in place of GPT-2's tanh one moves the logits by more.
FLOAT32_ATOL = 1e-4
# float16: relative to the logits' spread.
FLOAT16_RTOL = 2e-2
# c_fc's product with GPT-2-like magnitudes (pre-activations of standard deviation ~1.4,
# where tanh and erf GELU differ most): on an H200 the epilogue's float32 GELU was 5.4e-6
# from torch's tanh GELU and 4.7e-4 from the erf GELU (64 rows).
WEIGHT_SCALE = 0.05
BIAS_SCALE = 0.1
EPILOGUE_ATOL = 5e-5
ERF_DISTANCE = 1e-4
# A 16-bit MLP against HF's in float32, relative to the output's range: the dtype's rounding
# of the inputs, the hidden activations and the output.
MLP_16_BIT_RTOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2}


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
def test_the_epilogue_gelu_is_the_tanh_gelu_at_every_batch_size(rows):
    """The op the 16-bit MLP uses on CUDA (c_fc's product, bias and GELU in one) applies
    GPT-2's tanh GELU at any row count, a decode of one sequence included, not the erf
    GELU. Checked in float32, where the two are far apart; the formula is the dtype's."""
    generator = torch.Generator(device="cuda").manual_seed(rows)
    x, weight, bias = (
        torch.randn(shape, generator=generator, device="cuda") * scale
        for shape, scale in (((rows, 768), 1.0), ((3072, 768), WEIGHT_SCALE), ((3072,), BIAS_SCALE))
    )
    fused = torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    linear = torch.nn.functional.linear(x, weight, bias)
    tanh = torch.nn.functional.gelu(linear, approximate="tanh")
    erf = torch.nn.functional.gelu(linear)
    assert (fused - tanh).abs().max().item() < EPILOGUE_ATOL
    assert (fused - erf).abs().max().item() > ERF_DISTANCE


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("rows", [1, 64])
def test_16_bit_mlp_on_gpu_matches_transformers(rows, dtype):
    """The MLP as the 16-bit model runs it on CUDA (the GELU in the epilogue) against HF's
    GPT2MLP in float32 on the same 16-bit weights and inputs."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP as HFMLP

    torch.manual_seed(rows)
    config = GPT2Config(n_embd=768)
    ours = GPT2MLP(config).cuda().to(dtype)
    hf = HFMLP(config.inner_dim, transformers_config(config)).cuda().eval()
    with torch.no_grad():  # HF's Conv1D holds nn.Linear's weight transposed
        hf.c_fc.weight.copy_(ours.c_fc.weight.t().float())
        hf.c_fc.bias.copy_(ours.c_fc.bias.float())
        hf.c_proj.weight.copy_(ours.c_proj.weight.t().float())
        hf.c_proj.bias.copy_(ours.c_proj.bias.float())
        x = torch.randn(rows, config.n_embd, device="cuda").to(dtype)
        expected = hf(x.float())
        error = (ours(x).float() - expected).abs().max().item()
    assert error < MLP_16_BIT_RTOL[dtype] * expected.abs().max().item(), error


def transformers_config(config):
    from transformers import GPT2Config as HFConfig

    return HFConfig(n_embd=config.n_embd, activation_function="gelu_new", resid_pdrop=0.0)
