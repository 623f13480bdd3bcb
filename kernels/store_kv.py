"""store_kv: writes a step's new keys and values into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# A mixed batch stores from `num_decodes` rows in (paged_attention): slot_ptr's 16-byte
# alignment changes with it, and a scalar load gains nothing from it, so Triton is told
# not to compile a variant per alignment.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    block_size,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per token moves all its heads: a [BLOCK_H, BLOCK_D] tile is wide enough
    for 16-byte accesses (one program per head would give each thread under one element)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # A slot of -1 is padding (a CUDA-graph batch slot): load and store nothing.
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
        key = tl.load(key_ptr + token * key_stride_t + heads * key_stride_h + dims, mask=mask)
        value = tl.load(
            value_ptr + token * value_stride_t + heads * value_stride_h + dims, mask=mask
        )
        block = slot // block_size
        offset = slot % block_size
        dst = block * cache_stride_b + offset * cache_stride_s + heads * cache_stride_h + dims
        tl.store(k_cache_ptr + dst, key, mask=mask)
        tl.store(v_cache_ptr + dst, value, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache[slot // bs, slot % bs] = key[t] for every token t whose slot is not -1.

    key, value: [num_tokens, num_heads, head_dim], any token/head strides, last dim contiguous
    (views of the fused c_attn output). k_cache, v_cache: [num_blocks, block_size, num_heads,
    head_dim] with identical strides. slot_mapping: int64 [num_tokens]. num_heads counts K/V
    heads (one with multi-query attention), whatever the number of query heads.
    """
    num_tokens, num_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.shape[2:] != (num_heads, head_dim):
        raise ValueError(
            f"cache {tuple(k_cache.shape)} does not hold [*, *, {num_heads}, {head_dim}]"
        )
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("head_dim must be the contiguous dimension")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be int64 [{num_tokens}]")
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise ValueError(f"dtype mismatch: key {key.dtype}, cache {k_cache.dtype}")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1],
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The same contract in plain torch."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    k_cache[slots // block_size, slots % block_size] = key[keep]
    v_cache[slots // block_size, slots % block_size] = value[keep]
