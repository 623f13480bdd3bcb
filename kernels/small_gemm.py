"""A linear layer's weight packed for products of a few rows (cpu/small_gemm.h), and those
products: a decode step of one to `MAX_ROWS` sequences, on a CPU, where a token reads every
weight once and the product can only be as fast as the weight streams from memory.

oneDNN's products at one row run well below that (docs/benchmarks/history.md, "2026-12-01:
one user at a time"), and each is one Python-level op among a layer's dozen small ones; here
the weight is laid out as the kernel reads it (`pack_bf16`, `pack_int8`: column blocks of 16,
each k pair or quad of a block's columns side by side, as one vdpbf16ps or vpdpbusd takes
them). `small_linear` is the product for one layer (the LM head, a layer outside the fused
decode step); cpu/gpt2_decode.cpp runs a whole decode step over these weights.

`small_linear_ref` is its plain-torch twin: the packed weight unpacked, the product in
float32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from octavo.kernels import cpu_ops

MAX_ROWS = 8  # cpu/small_gemm.h's kMaxRows
COLUMNS = 16  # columns of a packed block
ZERO_POINT = 128  # the activations' unsigned codes: q_x + ZERO_POINT (quantization.py)
INT8_MAX = 127


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [R, C], scale float32 [R, 1]) with x ~ q * scale, symmetric per row: the int8
    scheme's one rounding (engine/worker/models/quantization.py), of weights per output
    channel and of activations per token. An all-zero row gets a tiny scale and zeros."""
    scale = x.abs().amax(dim=1, keepdim=True).float()
    scale = scale.clamp_(min=torch.finfo(torch.float32).tiny).div_(INT8_MAX)
    return x.div(scale).round_().to(torch.int8), scale


@dataclass(frozen=True)
class SmallWeight:
    """A weight [out_features, in_features] packed for small_linear, with what its product
    needs beside it, each padded to `padded_out` (a multiple of COLUMNS) columns:

    - bfloat16: `packed` [padded_out / 16, ceil(in / 2), 16, 2], `bias` float32 or None;
    - int8: `packed` the codes [padded_out / 16, ceil(in / 4), 16, 4], `w_scale` float32
      (per output column), `code_sums128` int32 (128 x each column's sum of codes: the
      correction for the activations' zero point), `bias` float32 or None.
    """

    packed: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    w_scale: torch.Tensor | None = None
    code_sums128: torch.Tensor | None = None

    @property
    def is_int8(self) -> bool:
        return self.packed.dtype == torch.int8


def _blocked(weight: torch.Tensor, group: int) -> torch.Tensor:
    """weight [N, K] -> [N' / 16, K' / group, 16, group], N' and K' padded with zeros."""
    n, k = weight.shape
    padded_n, padded_k = -(-n // COLUMNS) * COLUMNS, -(-k // group) * group
    full = weight.new_zeros(padded_n, padded_k)
    full[:n, :k] = weight
    blocks = full.view(padded_n // COLUMNS, COLUMNS, padded_k // group, group)
    return blocks.permute(0, 2, 1, 3).contiguous()


def _padded_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    out = torch.zeros(-(-n // COLUMNS) * COLUMNS, dtype=torch.float32)
    out[:n] = bias.detach().float()
    return out


def pack_bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> SmallWeight:
    """A bfloat16 weight [out, in] (nn.Linear's) and its bias, packed."""
    n, k = weight.shape
    packed = _blocked(weight.detach().to(torch.bfloat16), 2)
    return SmallWeight(packed, _padded_bias(bias, n), n, k)


def pack_int8(codes: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> SmallWeight:
    """int8 codes [out, in] with their per-column scales float32 [out] (quantization.py's
    quantize_per_row of the weight) and the bias, packed."""
    n, k = codes.shape
    padded_n = -(-n // COLUMNS) * COLUMNS
    scale = torch.zeros(padded_n, dtype=torch.float32)
    scale[:n] = w_scale
    sums = torch.zeros(padded_n, dtype=torch.int32)
    sums[:n] = codes.to(torch.int32).sum(dim=1) * ZERO_POINT
    return SmallWeight(_blocked(codes, 4), _padded_bias(bias, n), n, k, scale, sums)


def unpack(weight: SmallWeight) -> torch.Tensor:
    """The weight [out, in] as float32 (int8: codes x scale): the twin's view of it."""
    blocks, groups, columns, group = weight.packed.shape
    full = weight.packed.permute(0, 2, 1, 3).reshape(blocks * columns, groups * group).float()
    if weight.is_int8:
        assert weight.w_scale is not None
        full = full * weight.w_scale[:, None]
    return full[: weight.out_features, : weight.in_features]


def small_linear_ref(x: torch.Tensor, weight: SmallWeight) -> torch.Tensor:
    """small_linear in torch: x [R, in] -> [R, out] in x's dtype. int8 quantizes x per row
    first (quantize_per_row, as the operator does)."""
    values = x.float()
    if weight.is_int8:
        q, scale = quantize_per_row(x)
        values = q.float() * scale
    out = values @ unpack(weight).t()
    if weight.bias is not None:
        out = out + weight.bias[: weight.out_features]
    return out.to(x.dtype)


@functools.cache
def kernel_isa() -> frozenset[str]:
    """The weight kinds ("bfloat16", "int8") whose vector kernels this CPU's build has;
    empty where the operators cannot be built. The others run as plain loops (correct,
    slow): the engine takes the small-row path only for kinds named here."""
    if not cpu_ops.load():
        return frozenset()
    return frozenset(torch.ops.octavo_cpu.small_gemm_kernels())


def small_linear(x: torch.Tensor, weight: SmallWeight) -> torch.Tensor:
    """x [R, in] (1 <= R <= MAX_ROWS) @ weight^T + bias -> [R, out] in x's dtype, float32
    accumulation (bfloat16: x must be bfloat16). Needs cpu_ops.load()."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.is_int8:
        return torch.ops.octavo_cpu.small_linear_int8(
            x, weight.packed, weight.w_scale, weight.code_sums128, weight.bias,
            weight.out_features,
        )  # fmt: skip
    return torch.ops.octavo_cpu.small_linear_bf16(
        x, weight.packed, weight.bias, weight.out_features
    )
