"""add_layer_norm against its torch twin (the interpreter on CPU), and its input checks."""

import pytest
import torch

from octavo.kernels.layer_norm import add_layer_norm, add_layer_norm_ref

EPS = 1e-5
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("width", [64, 100])  # a power of two, and one the block masks
def test_matches_the_add_then_layer_norm(dtype, width):
    generator = torch.Generator().manual_seed(width)
    # x is a strided view (rows of a wider projection); the residual is offset from zero
    # so that a norm which forgot to centre would be far off.
    wide = torch.randn(5, width + 7, generator=generator).to(dtype)
    x = wide[:, 3 : 3 + width]
    residual = (torch.randn(5, width, generator=generator) * 4 + 3).to(dtype)
    weight = torch.randn(width, generator=generator).to(dtype)
    bias = torch.randn(width, generator=generator).to(dtype)
    out, total = add_layer_norm(x, residual, weight, bias, EPS)
    expected_out, expected_total = add_layer_norm_ref(x, residual, weight, bias, EPS)
    # The sum is one rounded add in either: bit-equal.
    assert torch.equal(total, expected_total)
    assert out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(
        out.float(), expected_out.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


def test_no_rows_gives_empty_results():
    x = torch.zeros(0, 8)
    out, total = add_layer_norm(x, x, torch.ones(8), torch.zeros(8), EPS)
    assert out.shape == total.shape == (0, 8)


def test_rejects_bad_inputs():
    x, weight = torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="residual"):
        add_layer_norm(x, torch.zeros(2, 9), weight, weight, EPS)
    with pytest.raises(ValueError, match="weight and bias"):
        add_layer_norm(x, x, torch.ones(9), weight, EPS)
    with pytest.raises(ValueError, match="dtype"):
        add_layer_norm(x, x.half(), weight, weight, EPS)
    with pytest.raises(ValueError, match="contiguous"):
        add_layer_norm(x.t(), x.t(), torch.ones(2), torch.ones(2), EPS)
