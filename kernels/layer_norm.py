"""add_layer_norm: a residual add and the LayerNorm that reads its sum, in one launch.

GPT-2 adds each sublayer's output to the residual stream and normalizes the sum before the
next sublayer (or the final norm). As two torch ops that is two launches and a round trip
of the sum through memory; here one program per row adds, writes the new residual and
normalizes it from registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Columns one warp covers: 32 threads x 8 elements, a 16-byte vector of fp16 each.
COLUMNS_PER_WARP = 256
MAX_WARPS = 8


@triton.jit
def _add_layer_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    residual_out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    residual_out_stride,
    width,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
    # The sum is rounded to the activations' dtype before the norm reads it, as the add and
    # then the LayerNorm of the unfused model (and of HF's) do.
    total = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
    tl.store(residual_out_ptr + row * residual_out_stride + cols, total, mask=mask)
    h = total.to(tl.float32)
    mean = tl.sum(h, axis=0) / width
    centred = tl.where(mask, h - mean, 0.0)
    variance = tl.sum(centred * centred, axis=0) / width
    rstd = 1.0 / tl.sqrt(variance + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = centred * rstd * weight + bias
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual), the sum rounded to the inputs' dtype first.

    x, residual: [num_tokens, width], same dtype, rows contiguous (any row stride).
    weight, bias: [width], any float dtype. Both results are new contiguous tensors of the
    inputs' dtype.
    """
    if x.dim() != 2 or x.shape != residual.shape:
        raise ValueError(
            f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must be one 2-D shape"
        )
    num_tokens, width = x.shape
    if weight.shape != (width,) or bias.shape != (width,):
        raise ValueError(f"weight and bias must be [{width}]")
    if x.dtype != residual.dtype:
        raise ValueError(f"dtype mismatch: x {x.dtype}, residual {residual.dtype}")
    if x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError("the width must be the contiguous dimension")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(out)
    if num_tokens == 0:
        return out, residual_out
    block = triton.next_power_of_2(width)
    _add_layer_norm_kernel[(num_tokens,)](
        x, residual, weight, bias, out, residual_out,
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
        width, eps,
        BLOCK=block, num_warps=min(max(block // COLUMNS_PER_WARP, 1), MAX_WARPS),
    )  # fmt: skip
    return out, residual_out


def add_layer_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same contract in plain torch: the add, then torch's LayerNorm."""
    total = x + residual
    return F.layer_norm(total, (total.shape[-1],), weight, bias, eps), total
