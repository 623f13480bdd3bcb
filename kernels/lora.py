"""add_lora: LoRA adapters' share of a product for rows of several adapters, on a GPU, in two
launches of Punica's BGMV shape (an adapter slot per row), with the same contract as
cpu_ops.add_lora_ and its torch twin engine/worker/lora.py's add_lora_ref.

- shrink: one program per row, h[t] = x[t] @ lora_a[slot] in float32;
- expand: one program per (row, column block), out[t, cols] += h[t] @ lora_b[slot][:, cols].

A row of slot -1 is masked, not branched on, and nothing is read back to the host: the
launches are the same whatever the step's mix of adapters, as a captured graph needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    h_ptr,
    x_stride,
    in_features,
    rank,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    valid = slot >= 0
    a_base = a_ptr + tl.maximum(slot, 0) * in_features * rank
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = (ks < in_features) & valid
        x = tl.load(x_ptr + row * x_stride + ks, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(
            a_base + ks[:, None] * rank + ranks[None, :],
            mask=k_mask[:, None] & (ranks[None, :] < rank),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(x[:, None] * a, axis=0)
    tl.store(h_ptr + row * rank + ranks, acc, mask=ranks < rank)


@triton.jit
def _expand_kernel(
    h_ptr,
    b_ptr,
    slots_ptr,
    out_ptr,
    out_stride,
    out_features,
    rank,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + row)
    col_mask = (cols < out_features) & (slot >= 0)
    ranks = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + row * rank + ranks, mask=ranks < rank, other=0.0)
    b = tl.load(
        b_ptr
        + tl.maximum(slot, 0) * rank * out_features
        + ranks[:, None] * out_features
        + cols[None, :],
        mask=(ranks[:, None] < rank) & col_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    grown = tl.sum(h[:, None] * b, axis=0)
    pointers = out_ptr + row * out_stride + cols
    out = tl.load(pointers, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(pointers, (out + grown).to(out_ptr.dtype.element_ty), mask=col_mask)


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """out[t] += (x[t] @ lora_a[s]) @ lora_b[s] in place for s = token_slots[t] (a row of -1
    is left), in float32 arithmetic: out [T, N] and x [T, K] with contiguous rows, lora_a
    [S, K, R] and lora_b [S, R, N] contiguous, token_slots int64 [T]; x, out and the
    factors of one dtype."""
    num_tokens, out_features = out.shape
    in_features, rank = lora_a.shape[1], lora_a.shape[2]
    if x.shape != (num_tokens, in_features) or lora_b.shape[1:] != (rank, out_features):
        raise ValueError(
            f"x {tuple(x.shape)}, out {tuple(out.shape)}, lora_a {tuple(lora_a.shape)} and "
            f"lora_b {tuple(lora_b.shape)} do not make [T, K] @ [K, R] @ [R, N]"
        )
    if (
        x.stride(1) != 1
        or out.stride(1) != 1
        or not (lora_a.is_contiguous() and lora_b.is_contiguous())
    ):
        raise ValueError("x's and out's rows, and the factors, must be contiguous")
    if num_tokens == 0:
        return
    block_r = triton.next_power_of_2(rank)
    h = torch.empty((num_tokens, rank), dtype=torch.float32, device=out.device)
    _shrink_kernel[(num_tokens,)](
        x, lora_a, token_slots, h, x.stride(0), in_features, rank,
        BLOCK_K=BLOCK_K, BLOCK_R=block_r,
    )  # fmt: skip
    _expand_kernel[(num_tokens, triton.cdiv(out_features, BLOCK_N))](
        h, lora_b, token_slots, out, out.stride(0), out_features, rank,
        BLOCK_N=BLOCK_N, BLOCK_R=block_r,
    )  # fmt: skip
