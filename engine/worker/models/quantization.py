"""`--quantization int8` on a CPU: int8 weights and int8 activations, the product in int32
on the CPU's int8 units (AMX-INT8 or AVX512-VNNI) through oneDNN.

Each weight is quantized once, at load, per output channel and symmetric: w ~ q_w * s_w,
q_w in [-127, 127], s_w = max |w[row]| / 127. Each step's activations are quantized per row
(per token), symmetric, at run time: x ~ q_x * s_x. Then x w^T ~ (q_x q_w^T) * s_x * s_w,
with q_x q_w^T exact in int32: only the two roundings to int8 cost accuracy. Per token, not
per tensor (one scale for the step, as torch's dynamic quantization takes), so that one
token's large activation does not coarsen the rest of the batch. The activations' codes are
stored unsigned, q_x + 128 with zero point 128, the same products exactly: oneDNN's int8
kernels take unsigned activations (AVX512-VNNI multiplies u8 by s8; AMX takes either), and
signed ones fall to its reference kernel on a CPU without AMX, about a thousand times slower.

Why torch's own oneDNN operators (`onednn::qlinear_prepack`, `onednn::qlinear_pointwise`,
the ones Inductor's x86 int8 path emits) and not torchao: torchao's eager CPU int8 layers
dequantize the weight on every call, about 10x slower than this at one row, and it ties the
project to a torch-version-matched extension. docs/benchmarks/history.md ("int8 weights") has the
figures against bfloat16 and the quality against float32 and HF's bfloat16.
"""

from __future__ import annotations

import torch
from torch import nn

from octavo.engine.worker.models.linear import pad_rows
from octavo.kernels import cpu_ops, small_gemm
from octavo.kernels.small_gemm import ZERO_POINT, quantize_per_row


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q uint8 [R, C], scale float32 [R, 1]): quantize_per_row's codes + ZERO_POINT, as the
    product takes them. (cpu_ops.quantize_rows is the same in one op.)"""
    q, scale = quantize_per_row(x)
    return (q.to(torch.int16) + ZERO_POINT).to(torch.uint8), scale


def rescale_rows_ref(out: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """cpu_ops.rescale_rows_ in torch: out[r] = out[r] * scale[r] + bias, in place."""
    out.mul_(scale[: out.shape[0]])
    if bias is not None:
        out.add_(bias)


class Int8Linear(nn.Module):
    """A Linear as int8 weights (`packed` by oneDNN, `weight_scale` float32 [out]) and its
    bias in the model's dtype; forward(x [rows, in]) -> [rows, out] in x's dtype, x's rows
    quantized per token on each call. Rows are padded as linear.py pads them (oneDNN keeps
    a kernel per shape). The activations' scaling runs as cpu_ops' one-op operators where
    they are built (at one row they are most of a layer's work besides the product), else
    as their torch twins. Up to small_gemm.MAX_ROWS rows take small_gemm's product over
    `small`, the codes packed for it (oneDNN's reads them at half the memory's speed at
    one row), where this CPU has its kernel."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        q, scale = quantize_per_row(layer.weight.detach())
        self.weight_scale = scale.squeeze(1)
        self.packed = torch.ops.onednn.qlinear_prepack(q, [1, self.in_features])
        self.zero_points = torch.zeros(self.out_features, dtype=torch.int32)
        self.bias = layer.bias
        fused = cpu_ops.load()
        self.quantize = cpu_ops.quantize_rows if fused else quantize_activations
        self.rescale_ = cpu_ops.rescale_rows_ if fused else rescale_rows_ref
        # The same codes packed for products of a few rows, where this CPU has their kernel.
        self.small = None
        if "int8" in small_gemm.kernel_isa():
            self.small = small_gemm.pack_int8(q, self.weight_scale, layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.small is not None and 0 < rows <= small_gemm.MAX_ROWS:
            return small_gemm.small_linear(x, self.small)
        q, scale = self.quantize(pad_rows(x))
        # The activations' scale is applied per row after the product (oneDNN takes one
        # scale for all of q): 1.0 here, so out = ((q - ZERO_POINT) q_w^T) * s_w.
        out = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, ZERO_POINT, self.packed, self.weight_scale, self.zero_points, None, 1.0, 0,
            x.dtype, "none", [], "",
        )[:rows]  # fmt: skip
        self.rescale_(out, scale, self.bias)
        return out
