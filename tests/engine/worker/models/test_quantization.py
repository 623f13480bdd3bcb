"""`--quantization int8`: the layer against its exact integer twin and the float product,
the embedded model's quality against HF's bfloat16 (greedy tokens, perplexity), the oneDNN
kernel it runs on, and clear errors for what it does not support."""

import math
import os
import subprocess
import sys

import pytest
import tokenizers
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from benchmarks import quantization_quality as quality
from octavo.engine import LLM, EngineConfig, SamplingParams
from octavo.engine.config import cpu_computes_int8
from octavo.engine.worker.models.linear import Linear
from octavo.engine.worker.models.quantization import Int8Linear, quantize_per_row
from octavo.server.cli import build_parser
from octavo.server.server_args import DEFAULT_MODEL

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="int8 products need oneDNN"
)
# The int8 layer itself runs only where the engine takes it (EngineCore refuses it elsewhere).
needs_int8_units = pytest.mark.skipif(
    not cpu_computes_int8(), reason="this CPU has no int8 units (AVX512-VNNI or AMX)"
)


def _layer(rows_out: int, cols: int, seed: int, dtype: torch.dtype) -> Linear:
    generator = torch.Generator().manual_seed(seed)
    layer = Linear(cols, rows_out)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(rows_out, cols, generator=generator) * 0.05)
        layer.bias.copy_(torch.randn(rows_out, generator=generator))
    return layer.to(dtype)


def int8_linear_ref(x: torch.Tensor, layer: Linear) -> torch.Tensor:
    """The int8 product in float64: both operands rounded to int8 as Int8Linear rounds them,
    their product exact, then both scales and the bias."""
    qw, sw = quantize_per_row(layer.weight.detach())
    qx, sx = quantize_per_row(x)
    product = qx.double() @ qw.double().t()
    return product * sx.double() * sw.double().t() + layer.bias.double()


@needs_int8_units
def test_int8_product_never_takes_onednns_reference_kernel():
    """oneDNN falls back to its reference int8 matmul (a thousand times slower) for operand
    types the CPU's int8 units do not take, as signed activations on a CPU without AMX:
    the implementation it names for the layer's product (ONEDNN_VERBOSE) is never `ref`.
    (More rows than small_gemm.MAX_ROWS: fewer take small_gemm's product, not oneDNN's.)"""
    script = (
        "import torch\n"
        "from octavo.engine.worker.models.quantization import Int8Linear\n"
        "layer = torch.nn.Linear(64, 32).to(torch.bfloat16)\n"
        "Int8Linear(layer)(torch.randn(16, 64).to(torch.bfloat16))\n"
    )
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    matmuls = [line for line in run.stdout.splitlines() if ",exec,cpu,matmul," in line]
    assert matmuls, run.stdout[-2000:]
    assert not any(",ref" in line for line in matmuls), matmuls


@needs_int8_units
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
def test_int8_layer_is_its_integer_twin_and_near_the_float_product(rows, dtype):
    layer = _layer(96, 128, rows, dtype)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(7)).to(dtype)
    x[0] *= 40  # one large row: per-token scales keep it from coarsening the others
    got = Int8Linear(layer)(x)
    assert got.shape == (rows, 96) and got.dtype == dtype
    twin = int8_linear_ref(x, layer)
    # Only the output's rounding to `dtype` separates the layer from its twin.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), twin, atol=4 * eps, rtol=2 * eps)
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    error = (got.double() - exact).abs().amax(dim=1)
    assert (error <= 0.02 * exact.abs().amax(dim=1) + 4 * eps).all()


@needs_int8_units
def test_an_all_zero_row_gives_the_bias():
    layer = _layer(8, 16, 0, torch.float32)
    got = Int8Linear(layer)(torch.zeros(2, 16))
    torch.testing.assert_close(got, layer.bias.detach().expand(2, 8))


@needs_int8_units
def test_int8_quality_on_held_out_text_is_near_hf_bfloat16s():
    """The embedded model over quantization_quality.py's held-out text: int8's perplexity is
    within 1% of HF bfloat16's, and it keeps HF float32's greedy tokens about as long as HF's
    own bfloat16 does (that benchmark: 526 against 668 of 768, int8's rounding flipping more
    near-ties, 11 continuations of 24 against 4, at the same perplexity; 25% less allowed)."""
    tokenizer = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    ids = tokenizer.encode(quality.held_out_text()).ids
    prompts = quality.greedy_prompts(ids)
    hf32 = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.bfloat16).eval()
    chunks = quality.windows(ids, hf32.config.n_positions)
    reference = [quality.hf_greedy(hf32, p) for p in prompts]
    hf_agreement = quality.agreement([quality.hf_greedy(hf16, p) for p in prompts], reference)
    hf_nll, count = quality.hf_nll(hf16, chunks)
    llm = LLM(str(DEFAULT_MODEL), device="cpu", quantization="int8", kv_cache_gb=0.25)
    model = llm.engine.core.runner.model
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.h[0].mlp.c_fc, Int8Linear)
    params = SamplingParams(temperature=0, max_tokens=quality.MAX_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert quality.agreement(ours, reference) >= 0.75 * hf_agreement
    nll, octavo_count = quality.octavo_nll(llm, chunks)
    assert octavo_count == count
    assert math.exp(nll / count) <= 1.01 * math.exp(hf_nll / count)
    block_manager = llm.engine.core.block_manager
    assert block_manager.num_free_blocks == block_manager.num_usable_blocks


def test_unknown_quantization_names_the_field():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int4")


def test_unknown_quantization_flag_is_refused_by_the_cli(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int4"])
    assert "--quantization" in capsys.readouterr().err


def test_int8_off_the_cpu_is_refused_at_start():
    with pytest.raises(ValueError, match="quantization 'int8' runs on a CPU"):
        LLM(str(DEFAULT_MODEL), device="cuda", quantization="int8")


def test_int8_on_a_cpu_without_int8_units_is_refused_at_start(monkeypatch):
    monkeypatch.setattr("octavo.engine.worker.worker.cpu_computes_int8", lambda: False)
    with pytest.raises(ValueError, match="quantization 'int8' needs a CPU with int8 units"):
        LLM(str(DEFAULT_MODEL), device="cpu", quantization="int8")
