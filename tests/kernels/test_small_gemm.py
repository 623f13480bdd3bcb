"""The small-row products (kernels/small_gemm.py, cpu/small_gemm.h) against their plain-torch
twin: bfloat16 and int8, one to eight rows, odd sizes (padding of both the columns and the
depth), every product shape of the GPT-2 presets and GPTBigCode's multi-query c_attn,
strided inputs, no bias; the build for a CPU without AVX-512; and the linear layers' small
path against their oneDNN path."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from octavo.engine.worker.models.linear import Linear, PackedLinear
from octavo.engine.worker.models.quantization import Int8Linear
from octavo.kernels import cpu_ops, small_gemm
from octavo.kernels.small_gemm import quantize_per_row

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="no C++ compiler here")

ODD_SHAPES = [(1, 1), (3, 17), (5, 33), (17, 15), (33, 40), (130, 47)]  # (in, out)
# Each GPT-2 preset's products (c_attn, attn.c_proj, c_fc, mlp.c_proj), and GPTBigCode's
# multi-query c_attn (n_embd + 2 head_dim wide) at the smallest width.
ZOO_SHAPES = [
    shape
    for width in (768, 1024, 1280, 1600)
    for shape in ((width, 3 * width), (width, width), (width, 4 * width), (4 * width, width))
] + [(768, 768 + 2 * 64)]


def _weight(in_features: int, out_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    return weight.to(torch.bfloat16), torch.randn(out_features, generator=generator).bfloat16()


def _packed(kind: str, weight: torch.Tensor, bias: torch.Tensor | None) -> small_gemm.SmallWeight:
    if kind == "bfloat16":
        return small_gemm.pack_bf16(weight, bias)
    codes, scale = quantize_per_row(weight)
    return small_gemm.pack_int8(codes, scale.squeeze(1), bias)


def _check(kind: str, in_features: int, out_features: int, rows: int, bias: bool = True):
    weight, b = _weight(in_features, out_features, in_features * 31 + out_features)
    packed = _packed(kind, weight, b if bias else None)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = small_gemm.small_linear(x, packed)
    expected = small_gemm.small_linear_ref(x, packed)
    assert got.shape == (rows, out_features) and got.dtype == x.dtype
    # The same float32 sums in another order, then one rounding to bfloat16.
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", ["bfloat16", "int8"])
@pytest.mark.parametrize("rows", range(1, small_gemm.MAX_ROWS + 1))
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=str)
def test_odd_sizes_match_the_twin(kind, rows, shape):
    _check(kind, *shape, rows)


@pytest.mark.parametrize("kind", ["bfloat16", "int8"])
@pytest.mark.parametrize("rows", [1, 5, 8])
@pytest.mark.parametrize("shape", ZOO_SHAPES, ids=str)
def test_every_preset_shape_matches_the_twin(kind, rows, shape):
    _check(kind, *shape, rows)


@pytest.mark.parametrize("kind", ["bfloat16", "int8"])
def test_no_bias_and_strided_inputs(kind):
    _check(kind, 64, 48, 3, bias=False)
    weight, b = _weight(64, 48, 1)
    packed = _packed(kind, weight, b)
    wide = torch.randn(4, 3, 64).bfloat16()
    rows_apart = wide[:, 1]  # rows 192 apart
    columns_apart = torch.randn(64, 4).bfloat16().t()  # a column stride of 4
    for x in (rows_apart, columns_apart):
        torch.testing.assert_close(
            small_gemm.small_linear(x, packed).float(),
            small_gemm.small_linear_ref(x.contiguous(), packed).float(),
            atol=2e-2,
            rtol=1e-2,
        )


def test_unpack_inverts_the_packing():
    weight, bias = _weight(33, 40, 3)
    unpacked = small_gemm.unpack(_packed("bfloat16", weight, bias))
    assert unpacked.shape == (40, 33)
    torch.testing.assert_close(unpacked, weight.float())
    codes, scale = quantize_per_row(weight)
    torch.testing.assert_close(
        small_gemm.unpack(_packed("int8", weight, bias)), codes.float() * scale
    )


def test_more_rows_than_the_kernel_takes_is_refused():
    weight, bias = _weight(16, 16, 0)
    packed = _packed("bfloat16", weight, bias)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        small_gemm.small_linear(torch.zeros(small_gemm.MAX_ROWS + 1, 16).bfloat16(), packed)


def test_this_cpus_vector_kernels_are_found():
    """The engine takes the small-row path only for kinds kernel_isa names: on a CPU with
    AVX512-BF16 and AVX512-VNNI (the project's machines) both must be there."""
    flags = next(
        (
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ),
        "",
    ).split()
    if "avx512_bf16" in flags:
        assert "bfloat16" in small_gemm.kernel_isa()
    if "avx512_vnni" in flags and "avx512bw" in flags:
        assert "int8" in small_gemm.kernel_isa()


@pytest.mark.parametrize("layer_class", [PackedLinear, Int8Linear])
def test_a_layers_small_rows_match_its_onednn_rows(layer_class):
    """A layer's first rows give the same result whether the batch takes the small-row
    product (up to MAX_ROWS rows) or oneDNN's (more)."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no bfloat16 products on this CPU")
    layer = Linear(96, 80)
    layer = layer.to(torch.bfloat16)
    packed = layer_class(layer)
    if packed.small is None:
        pytest.skip("no small-row kernel of this kind here")
    x = torch.randn(small_gemm.MAX_ROWS + 8, 96).bfloat16()
    small = packed(x[: small_gemm.MAX_ROWS])
    large = packed(x)[: small_gemm.MAX_ROWS]
    torch.testing.assert_close(small.float(), large.float(), atol=2e-2, rtol=1e-2)


FALLBACK_SCRIPT = """
import sys, torch
from torch.utils import cpp_extension
from octavo.kernels import cpu_ops, small_gemm
from octavo.kernels.small_gemm import quantize_per_row
source = [str(s) for s in cpu_ops.SOURCES if s.name == "small_linear.cpp"]
cpp_extension.load(name="octavo_small_gemm_plain_loops", sources=source,
                   extra_cflags=["-O2", "-march=x86-64-v2", "-fopenmp"],
                   extra_ldflags=["-fopenmp"], is_python_module=False,
                   build_directory=sys.argv[1])
assert torch.ops.octavo_cpu.small_gemm_kernels() == []
worst = 0.0
for k, n in [(3, 17), (33, 40), (130, 47), (768, 300)]:
    for rows in (1, 3, 8):
        w = (torch.randn(n, k) * 0.05).bfloat16()
        b = torch.randn(n).bfloat16()
        x = torch.randn(rows, k).bfloat16()
        codes, scale = quantize_per_row(w)
        for packed in (small_gemm.pack_bf16(w, b), small_gemm.pack_int8(codes, scale[:, 0], b)):
            got = small_gemm.small_linear(x, packed).float()
            want = small_gemm.small_linear_ref(x, packed).float()
            worst = max(worst, ((got - want).abs() / (want.abs() + 1)).max().item())
print(worst)
"""


def test_the_plain_loops_of_a_cpu_without_avx512_match_the_twin(tmp_path):
    """The build for a CPU without AVX-512 (x86-64-v2) computes the same layouts by plain
    loops: built here as such in a process of its own, against the twin."""
    # The venv's own bin folder on PATH: torch's extension loader runs its `ninja`.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT, str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PATH": path},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(run.stdout.strip().splitlines()[-1]) < 2e-2
