"""copy_blocks: a step's copy-on-write block copies, every layer's K and V, in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements one program moves per loop iteration.
_COPY_TILE = 1024


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,
    mapping_ptr,
    plane_stride,
    block_stride,
    block_numel,
    TILE: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    plane = tl.program_id(1).to(tl.int64)  # layer * 2 + (0 for K, 1 for V)
    src = tl.load(mapping_ptr + pair * 2).to(tl.int64)
    dst = tl.load(mapping_ptr + pair * 2 + 1).to(tl.int64)
    src_base = cache_ptr + plane * plane_stride + src * block_stride
    dst_base = cache_ptr + plane * plane_stride + dst * block_stride
    for start in range(0, block_numel, TILE):
        offsets = start + tl.arange(0, TILE)
        mask = offsets < block_numel
        tl.store(dst_base + offsets, tl.load(src_base + offsets, mask=mask), mask=mask)


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """kv_cache[:, :, dst] = kv_cache[:, :, src] for every (src, dst) row, bit-exact.

    kv_cache: contiguous [num_layers, 2, num_blocks, block_size, num_heads, head_dim];
    block_mapping: int64 [num_pairs, 2]. Destinations must be distinct and never sources.
    """
    if kv_cache.dim() != 6 or not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be a contiguous [L, 2, blocks, bs, heads, dim] tensor")
    if (
        block_mapping.dtype != torch.int64
        or block_mapping.dim() != 2
        or block_mapping.shape[1] != 2
        or not block_mapping.is_contiguous()
    ):
        raise ValueError("block_mapping must be a contiguous int64 [num_pairs, 2] tensor")
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    num_layers, two, num_blocks = kv_cache.shape[:3]
    planes = kv_cache.view(num_layers * two, num_blocks, -1)
    _copy_blocks_kernel[(num_pairs, num_layers * two)](
        planes, block_mapping, planes.stride(0), planes.stride(1), planes.shape[2],
        TILE=_COPY_TILE,
    )  # fmt: skip


def copy_blocks_ref(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """The same contract in plain torch."""
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    kv_cache[:, :, dst] = kv_cache[:, :, src]
