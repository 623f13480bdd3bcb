"""Linear layers whose 16-bit products on a CPU see a bounded set of row counts.

torch runs a CPU product in bfloat16 or float16 through oneDNN, which compiles a kernel per
(rows, weight) shape and caches it (up to 1,024, each a few hundred KB). An engine's row
count is its step's token count, different nearly every step, so a serving process would
grow by hundreds of MB as that cache filled. Rows are padded up to `row_bucket` instead (at
most 1/8 more rows), so the shapes, and the cache, stay few. float32 products (MKL, no
per-shape kernels) and CUDA's are left as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over x [rows, in], its rows padded to `row_bucket` for a 16-bit product on
    a CPU (the padding's rows are zeros, and dropped from the result)."""
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dtype == torch.float32 or x.dim() != 2:
        return F.linear(x, weight, bias)
    padded_rows = row_bucket(rows)
    if padded_rows == rows:
        return F.linear(x, weight, bias)
    padded = x.new_zeros((padded_rows, x.shape[1]))
    padded[:rows] = x
    return F.linear(padded, weight, bias)[:rows]


class Linear(nn.Linear):
    """nn.Linear (the same parameters, loaded by the same names) through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
