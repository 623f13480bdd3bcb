"""Row buckets of the CPU's 16-bit products: few shapes, little padding, the same rows out,
and a process that stops growing once each bucket's kernel is compiled; the packed layers
give F.linear's product and replace every Linear of a model."""

import random

import pytest
import torch
import torch.nn.functional as F

from octavo.engine.config import cpu_computes_bfloat16
from octavo.engine.worker.models.linear import (
    BUCKETS_PER_OCTAVE,
    EXACT_ROWS,
    Linear,
    PackedLinear,
    can_pack,
    linear,
    replace_linears,
    row_bucket,
)


def test_buckets_are_few_and_pad_little():
    buckets = [row_bucket(rows) for rows in range(1, 2049)]
    assert buckets[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))
    assert all(b >= r and b <= r * (1 + 1 / BUCKETS_PER_OCTAVE) for r, b in enumerate(buckets, 1))
    assert buckets == sorted(buckets)
    assert len(set(buckets)) <= EXACT_ROWS + 7 * BUCKETS_PER_OCTAVE  # 16 -> 2048: 7 doublings


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 16, 17, 50, 300])
def test_padded_rows_give_the_unpadded_product(dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=generator).to(dtype)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    got = linear(x, weight, bias)
    assert got.shape == (rows, 96) and got.dtype == dtype
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN has no bfloat16 here")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 16, 17, 50, 300])
def test_packed_layer_gives_f_linears_product(rows, bias):
    generator = torch.Generator().manual_seed(rows)
    layer = Linear(64, 96, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64, generator=generator))
        if bias:
            layer.bias.copy_(torch.randn(96, generator=generator))
    x = torch.randn(rows, 64, generator=generator).to(torch.bfloat16)
    got = PackedLinear(layer)(x)
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
    bias_ = None if layer.bias is None else layer.bias.float()
    want = F.linear(x.float(), layer.weight.float(), bias_)
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=2e-2)


def test_float32_is_never_packed():
    assert not can_pack(torch.float32)


def test_replace_linears_swaps_every_linear_and_only_those():
    inner = torch.nn.Sequential(Linear(8, 4))
    model = torch.nn.Sequential(Linear(8, 8), torch.nn.Linear(8, 8), inner)
    replace_linears(model, lambda layer: torch.nn.Identity())
    assert isinstance(model[0], torch.nn.Identity) and isinstance(model[2][0], torch.nn.Identity)
    assert type(model[1]) is torch.nn.Linear


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not cpu_computes_bfloat16(), reason="oneDNN emulates bfloat16 here")
def test_any_row_count_reuses_its_buckets_kernels():
    """Once every bucket up to 512 rows has run, 1,000 products of random row counts add no
    memory. Unpadded, each new row count compiles and caches a kernel of its own (about
    0.3 MB here: tens of MB over these row counts)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=generator).to(torch.bfloat16)
    weight = torch.randn(384, 128, generator=generator).to(torch.bfloat16)
    for rows in sorted({row_bucket(r) for r in range(1, 513)}):
        linear(x[:rows], weight)
    before = _resident_bytes()
    rng = random.Random(0)
    for _ in range(1000):
        linear(x[: rng.randint(1, 512)], weight)
    assert _resident_bytes() - before < 2 * 1024 * 1024


@pytest.mark.skipif(not cpu_computes_bfloat16(), reason="oneDNN emulates bfloat16 here")
def test_any_row_count_reuses_its_buckets_kernels_packed():
    """The same for a packed layer, whose oneDNN kernels are cached per shape too."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=generator).to(torch.bfloat16)
    layer = PackedLinear(Linear(128, 384).to(torch.bfloat16))
    for rows in sorted({row_bucket(r) for r in range(1, 513)}):
        layer(x[:rows])
    before = _resident_bytes()
    rng = random.Random(0)
    for _ in range(1000):
        layer(x[: rng.randint(1, 512)])
    assert _resident_bytes() - before < 2 * 1024 * 1024
