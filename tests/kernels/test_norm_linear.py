"""norm_linear and few_rows_linear against torch (the interpreter on CPU), and their input
checks."""

import pytest
import torch

from octavo.kernels.norm_linear import (
    MAX_ROWS,
    column_block,
    few_rows_linear,
    norm_linear,
    norm_linear_ref,
)

EPS = 1e-5
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2}


def operands(rows: int, width: int, out_width: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=generator) * scale + shift).to(dtype)

    # x is a strided view (rows of a wider projection); the residual is offset from zero so
    # that a norm which forgot to centre would be far off.
    x = randn(rows, width + 5)[:, 2 : 2 + width]
    residual = randn(rows, width, scale=4.0, shift=3.0)
    norm_weight, norm_bias = randn(width), randn(width)
    weight = randn(out_width, width, scale=width**-0.5)
    return x, residual, norm_weight, norm_bias, EPS, weight, randn(out_width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("gelu", [False, True], ids=["linear", "gelu"])
@pytest.mark.parametrize(
    "rows,width,out_width",
    [(1, 48, 40), (5, 160, 150), (MAX_ROWS, 64, 200)],  # widths the K and N tiles mask
)
def test_matches_add_layer_norm_then_linear(rows, width, out_width, gelu, dtype):
    args = operands(rows, width, out_width, dtype, seed=rows + width)
    out, total = norm_linear(*args, gelu=gelu)
    expected_out, expected_total = norm_linear_ref(*args, gelu=gelu)
    # The sum is one rounded add in either, written by the first column tile only.
    assert torch.equal(total, expected_total)
    assert out.dtype == dtype and out.shape == (rows, out_width) and out.is_contiguous()
    torch.testing.assert_close(
        out.float(), expected_out.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows,width,out_width", [(1, 48, 40), (MAX_ROWS, 200, 72)])
def test_few_rows_linear_is_the_product_alone(rows, width, out_width, dtype):
    x, _, _, _, _, weight, bias = operands(rows, width, out_width, dtype, seed=width)
    out = few_rows_linear(x, weight, bias)
    assert out.dtype == dtype and out.shape == (rows, out_width)
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    with pytest.raises(ValueError, match="must be"):
        few_rows_linear(operands(MAX_ROWS + 1, 8, 16, dtype)[0], weight, bias)


def test_columns_spread_over_every_sm_in_tiles_a_dot_takes():
    assert column_block(2304, sms=1) == 64
    assert column_block(2304, sms=132) == 16  # 144 programs of 16 columns
    assert column_block(3072, sms=40) == 64
    assert column_block(40, sms=132) == 16


def test_no_rows_gives_empty_results():
    args = operands(0, 8, 16, torch.float32)
    out, total = norm_linear(*args)
    assert out.shape == (0, 16) and total.shape == (0, 8)


def test_rejects_bad_inputs():
    x, residual, norm_weight, norm_bias, eps, weight, bias = operands(2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="at most"):
        norm_linear(*operands(MAX_ROWS + 1, 8, 16, torch.float32))
    with pytest.raises(ValueError, match="one 2-D shape"):
        norm_linear(x, residual[:1], norm_weight, norm_bias, eps, weight, bias)
    with pytest.raises(ValueError, match="out_width"):
        norm_linear(x, residual, norm_weight, norm_bias, eps, weight[:, :4], bias)
    with pytest.raises(ValueError, match="dtype mismatch"):
        norm_linear(x, residual, norm_weight, norm_bias, eps, weight.half(), bias)
    with pytest.raises(ValueError, match="contiguous"):
        norm_linear(x, residual, norm_weight, norm_bias, eps, weight.t().contiguous().t(), bias)
    with pytest.raises(ValueError, match="must be contiguous"):
        norm_linear(x, residual, norm_weight, norm_bias, eps, weight, weight[:, 0])
