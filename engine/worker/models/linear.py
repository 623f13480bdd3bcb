"""The model's linear layers, and how their products run on a CPU.

`Linear` is nn.Linear (the checkpoint's parameters, by the same names). On a CPU, after
loading, `replace_linears` swaps each for a `PackedLinear` where the weights are 16-bit
and the CPU computes them (`can_pack`), or for quantization.py's `Int8Linear`: its product
goes through oneDNN with the weight reordered once into oneDNN's blocked layout, where
torch's F.linear would reorder it again on every call (docs/benchmarks/history.md,
"Prepacked weights").

torch runs a CPU product in bfloat16 or float16 through oneDNN, which compiles a kernel per
(rows, weight) shape and caches it (up to 1,024, each a few hundred KB). An engine's row
count is its step's token count, different nearly every step, so a serving process would
grow by hundreds of MB as that cache filled. Rows are padded up to `row_bucket` instead (at
most 1/8 more rows), so the shapes, and the cache, stay few. float32 products (MKL, no
per-shape kernels) and CUDA's are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from octavo.kernels import small_gemm

# Row counts up to this are their own bucket (decode batches of a few sequences).
EXACT_ROWS = 16
# Buckets per doubling above EXACT_ROWS: padding adds at most 1/BUCKETS_PER_OCTAVE rows.
BUCKETS_PER_OCTAVE = 8


def row_bucket(rows: int) -> int:
    """The row count `rows` is padded to: itself up to EXACT_ROWS, then the next multiple of
    1/BUCKETS_PER_OCTAVE of the power of two at or below it."""
    if rows <= EXACT_ROWS:
        return rows
    step = (1 << (rows.bit_length() - 1)) // BUCKETS_PER_OCTAVE
    return -(-rows // step) * step


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] with zero rows appended up to row_bucket(rows) (x itself when none are)."""
    rows = x.shape[0]
    padded_rows = row_bucket(rows)
    if padded_rows == rows:
        return x
    padded = x.new_zeros((padded_rows, x.shape[1]))
    padded[:rows] = x
    return padded


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over x [rows, in], its rows padded to `row_bucket` for a 16-bit product on
    a CPU (the padding's rows are zeros, and dropped from the result)."""
    if x.device.type != "cpu" or x.dtype == torch.float32 or x.dim() != 2:
        return F.linear(x, weight, bias)
    return F.linear(pad_rows(x), weight, bias)[: x.shape[0]]


class Linear(nn.Linear):
    """nn.Linear (the same parameters, loaded by the same names) through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs products of this dtype on this CPU from a packed weight: 16-bit
    dtypes the CPU computes. Not float32: there the packed path is slower than torch's own
    (MKL) at one row, and it would change float32's rounding, which parity with HF relies on."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


class PackedLinear(nn.Module):
    """A Linear's product on a CPU through oneDNN, its 16-bit weight reordered once into
    oneDNN's layout (`packed`, an opaque tensor: not a parameter, so no state dict or
    `.to()` sees it). Rows are padded as `linear` pads them. A bfloat16 weight is also
    packed for products of up to small_gemm.MAX_ROWS rows (`small`), where this CPU has
    their kernel: at one row oneDNN's reads the weight well below the memory's speed."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        weight = layer.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = layer.bias
        self.small = None
        if weight.dtype == torch.bfloat16 and "bfloat16" in small_gemm.kernel_isa():
            self.small = small_gemm.pack_bf16(weight, layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None and 0 < x.shape[0] <= small_gemm.MAX_ROWS:
            return small_gemm.small_linear(x, self.small)
        padded = pad_rows(x)
        out = torch.ops.mkldnn._linear_pointwise(padded, self.packed, self.bias, "none", [], "")
        return out[: x.shape[0]]


def replace_linears(model: nn.Module, replacement: Callable[[Linear], nn.Module]) -> None:
    """Replaces every `Linear` of `model` by replacement(that layer). A weight tied to an
    embedding stays the embedding's: the replacement keeps what it made of it."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, Linear):
                setattr(module, name, replacement(child))
