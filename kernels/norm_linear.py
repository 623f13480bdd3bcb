"""norm_linear: a residual add, the LayerNorm of its sum and the linear layer that reads the
norm, in one launch, for the few rows of a small decode step; few_rows_linear: the same
kernel's product alone (a layer's two c_proj).

With a handful of sequences a decode step is bound by its launches, not by arithmetic: a
layer's add_layer_norm and the matrix product after it are two kernels over a few rows,
and the norm makes a round trip through memory between them. Here every program
normalizes all the rows itself (three passes over a row of one model width, from cache)
and multiplies them by its BLOCK_N columns of the weight, so the weight is still read once
and the norm stays in registers. That holds while the rows fit one tile of tl.dot's
minimum height (MAX_ROWS); with more, each row tile would read the whole weight again,
and add_layer_norm then the library's matrix product is the path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from octavo.kernels.layer_norm import add_layer_norm_ref
from octavo.kernels.paged_attention import MIN_DOT_DIM, num_sms

# Rows per launch: one tile of tl.dot's minimum height.
MAX_ROWS = MIN_DOT_DIM
# Width of a K step: a [16, 64] tile of the norm and a [64, BLOCK_N] tile of the weight.
BLOCK_K = 64
# Output columns per program: the widest tile that still gives every SM a program, so that
# the whole GPU streams the weight; never under tl.dot's minimum.
MAX_BLOCK_N = 64
# The tanh approximation of GELU (GPT-2's gelu_new): 0.5 x (1 + tanh(sqrt(2/pi) (x + c x^3))).
SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)
GELU_CUBIC: tl.constexpr = tl.constexpr(0.044715)


@triton.jit
def _tanh_gelu(x):
    inner = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)
    # tanh(y) = 1 - 2 / (e^2y + 1): +-1 in the limits, where e^2y is inf or 0.
    return 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))


@triton.jit
def _summed(x_ptr, residual_ptr, x_stride, residual_stride, rows, cols, mask, out_dtype):
    """x + residual over a [BLOCK_M, BLOCK_K] tile, rounded to the activations' dtype as the
    unfused add is, then widened for the statistics."""
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    residual = tl.load(
        residual_ptr + rows[:, None] * residual_stride + cols[None, :], mask=mask, other=0.0
    )
    return (x.to(tl.float32) + residual.to(tl.float32)).to(out_dtype).to(tl.float32)


@triton.jit
def _norm_linear_kernel(
    x_ptr, residual_ptr, norm_weight_ptr, norm_bias_ptr, weight_ptr, bias_ptr, out_ptr,
    residual_out_ptr, num_rows, width, out_width, x_stride, residual_stride, weight_stride,
    out_stride, residual_out_stride, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
    GELU: tl.constexpr,
):  # fmt: skip
    """With NORM, the product's input is layer_norm(x + residual), the sum also written to
    residual_out; without, x itself (residual, the norm's and residual_out's pointers are
    not read)."""
    column_tile = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    row_mask = rows < num_rows
    mean = tl.zeros([BLOCK_M], tl.float32)
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        # Pass 1: the sum's mean. The first column tile also writes the sum, the residual
        # stream from here on.
        total = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, width, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            mask = row_mask[:, None] & (cols < width)[None, :]
            h = _summed(x_ptr, residual_ptr, x_stride, residual_stride, rows, cols, mask, dtype)
            if column_tile == 0:
                tl.store(
                    residual_out_ptr + rows[:, None] * residual_out_stride + cols[None, :],
                    h.to(dtype),
                    mask=mask,
                )
            total += tl.sum(h, axis=1)
        mean = total / width
        # Pass 2: the variance about it (centred, as add_layer_norm computes it).
        squares = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, width, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            mask = row_mask[:, None] & (cols < width)[None, :]
            h = _summed(x_ptr, residual_ptr, x_stride, residual_stride, rows, cols, mask, dtype)
            centred = tl.where(mask, h - mean[:, None], 0.0)
            squares += tl.sum(centred * centred, axis=1)
        rstd = 1.0 / tl.sqrt(squares / width + eps)
    # Pass 3: the input (with NORM, the norm, rounded to the activations' dtype as the
    # unfused LayerNorm's output is) times this program's columns of the weight
    # ([out_width, width], nn.Linear's).
    columns = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    column_mask = columns < out_width
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, width, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_mask = cols < width
        mask = row_mask[:, None] & col_mask[None, :]
        if NORM:
            h = _summed(x_ptr, residual_ptr, x_stride, residual_stride, rows, cols, mask, dtype)
            gamma = tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            beta = tl.load(norm_bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            normed = (h - mean[:, None]) * rstd[:, None] * gamma[None, :] + beta[None, :]
            normed = tl.where(mask, normed, 0.0).to(dtype)
        else:
            normed = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
        weight = tl.load(
            weight_ptr + columns[None, :].to(tl.int64) * weight_stride + cols[:, None],
            mask=col_mask[:, None] & column_mask[None, :],
            other=0.0,
        )
        acc += tl.dot(normed, weight, input_precision="ieee")
    acc += tl.load(bias_ptr + columns, mask=column_mask, other=0.0).to(tl.float32)[None, :]
    if GELU:
        acc = _tanh_gelu(acc)
    tl.store(
        out_ptr + rows[:, None] * out_stride + columns[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & column_mask[None, :],
    )


def column_block(out_width: int, sms: int) -> int:
    """BLOCK_N: the widest power of two up to MAX_BLOCK_N that still launches a program per
    SM, and never under MIN_DOT_DIM."""
    block = MAX_BLOCK_N
    while block > MIN_DOT_DIM and triton.cdiv(out_width, block) < sms:
        block //= 2
    return block


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    gelu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(layer_norm(x + residual)), x + residual), the tanh GELU applied to the first
    with `gelu`: add_layer_norm, then F.linear (and the GELU), in one launch.

    x, residual: [num_rows <= MAX_ROWS, width], one dtype, rows contiguous (any row stride).
    norm_weight, norm_bias: [width]; weight: [out_width, width] (nn.Linear's), rows
    contiguous; bias: [out_width]. Both results are new contiguous tensors of x's dtype.
    """
    if x.dim() != 2 or x.shape != residual.shape:
        raise ValueError(
            f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must be one 2-D shape"
        )
    num_rows, width = x.shape
    if num_rows > MAX_ROWS:
        raise ValueError(f"norm_linear takes at most {MAX_ROWS} rows, got {num_rows}")
    out_width = weight.shape[0]
    if norm_weight.shape != (width,) or norm_bias.shape != (width,):
        raise ValueError(f"norm_weight and norm_bias must be [{width}]")
    _check_weight(x, weight, bias)
    if x.dtype != residual.dtype:
        raise ValueError(f"dtype mismatch: x {x.dtype}, residual {residual.dtype}")
    if residual.stride(1) != 1 or norm_weight.stride(0) != 1 or norm_bias.stride(0) != 1:
        raise ValueError("residual's rows, norm_weight and norm_bias must be contiguous")
    out = torch.empty((num_rows, out_width), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out, residual_out
    _launch(x, residual, norm_weight, norm_bias, eps, weight, bias, out, residual_out, gelu)
    return out, residual_out


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of up to MAX_ROWS rows, by norm_linear's kernel
    without the norm: one launch where the library may take two (a split-K product and its
    reduce). x: [num_rows, width], rows contiguous; weight and bias as norm_linear's."""
    if x.dim() != 2 or x.shape[0] > MAX_ROWS:
        raise ValueError(f"x must be [<= {MAX_ROWS}, width], got {tuple(x.shape)}")
    num_rows, width = x.shape
    out_width = weight.shape[0]
    _check_weight(x, weight, bias)
    out = torch.empty((num_rows, out_width), dtype=x.dtype, device=x.device)
    if num_rows:
        _launch(x, x, bias, bias, 0.0, weight, bias, out, out, gelu=False, norm=False)
    return out


def _check_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    width, out_width = x.shape[1], weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != width or bias.shape != (out_width,):
        raise ValueError(
            f"weight {tuple(weight.shape)} and bias {tuple(bias.shape)} must be "
            f"[out_width, {width}] and [out_width]"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"dtype mismatch: x {x.dtype}, weight {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or bias.stride(0) != 1:
        raise ValueError("x's and weight's rows, and bias, must be contiguous")


def _launch(
    x, residual, norm_weight, norm_bias, eps, weight, bias, out, residual_out, gelu: bool,
    norm: bool = True,
) -> None:  # fmt: skip
    out_width = weight.shape[0]
    block_n = column_block(out_width, num_sms(x.device))
    _norm_linear_kernel[(triton.cdiv(out_width, block_n),)](
        x, residual, norm_weight, norm_bias, weight, bias, out, residual_out,
        x.shape[0], x.shape[1], out_width, x.stride(0), residual.stride(0), weight.stride(0),
        out.stride(0), residual_out.stride(0), eps,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=BLOCK_K, NORM=norm, GELU=gelu,
    )  # fmt: skip


def norm_linear_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    gelu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same contract in plain torch: add_layer_norm_ref, F.linear, the tanh GELU."""
    normed, total = add_layer_norm_ref(x, residual, norm_weight, norm_bias, eps)
    out = F.linear(normed, weight, bias)
    return (F.gelu(out, approximate="tanh") if gelu else out), total
