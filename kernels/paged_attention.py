"""paged_attention: causal attention for a mixed batch of prefill chunks and decodes, reading
every key and value (cached context and this step's tokens) through the block table.

Grouped queries (multi-query attention): the cache may hold fewer K/V heads than q has query
heads, each K/V head shared by GROUP_SIZE = num_heads // num_kv_heads consecutive query heads.
A program of query head h reads K/V head h // GROUP_SIZE in place: nothing is copied per
query head. GROUP_SIZE is a compile-time constant, so at 1 (GPT-2) the division folds away
and the kernels are the ungrouped ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Split-KV limits of the decode path, from kernel_bench --sweep on an H100 (GPT-2 heads,
# fp16; results/kernel_bench_sweep_nvidia_h100_80gb_hbm3.json, now in git history):
# splitting pays while a launch has too few programs to fill the SMs, fewer than
# SPLIT_BELOW_PROGRAMS_PER_SM per SM (at large batches splits only add their reduce), down to
# splits of one BLOCK_N tile; contexts under MIN_CONTEXT_TO_SPLIT keys gain nothing from it.
SPLIT_BELOW_PROGRAMS_PER_SM = 4
MIN_CONTEXT_TO_SPLIT = 256
MIN_KEYS_PER_SPLIT = 64
MAX_SPLITS = 16
LOG2_E = 1.4426950408889634
# Every tl.dot dimension must be >= 16 on the GPU compiler (the interpreter takes any): the
# tiles, and head_dim, which the tl.dot path pads with masked lanes up to it.
MIN_DOT_DIM = 16
# Triton's defaults; the heuristics below override them where kernel_bench --sweep showed
# a better choice on an H100.
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of the tl.dot path: BLOCK_M queries x BLOCK_N keys per tile."""

    block_m: int
    block_n: int
    num_warps: int = DEFAULT_NUM_WARPS
    num_stages: int = DEFAULT_NUM_STAGES

    def __post_init__(self):
        for tile in (self.block_m, self.block_n):
            if tile < MIN_DOT_DIM or not _is_power_of_2(tile):
                raise ValueError(f"prefill tiles must be powers of 2 >= {MIN_DOT_DIM}: {self}")


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the decode path: BLOCK_N keys per loop iteration."""

    block_n: int
    num_warps: int = DEFAULT_NUM_WARPS

    def __post_init__(self):
        if not _is_power_of_2(self.block_n):
            raise ValueError(f"decode block_n must be a power of 2: {self}")


def prefill_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """The tl.dot path's tiles, from head_dim and dtype only.

    16-bit inputs fit 64 x 64 tiles with head_dim <= 128 in shared memory; fp32 operands
    take twice the space, as does a larger head_dim. Never below MIN_DOT_DIM.
    """
    if dtype == torch.float32 or head_dim > 128:
        return PrefillConfig(block_m=32, block_n=32)
    # Two stages: on an H100 this beat three at every swept shape (fp16, head_dim 64).
    return PrefillConfig(block_m=64, block_n=64, num_stages=2)


# 64 keys per iteration with two warps: the best launch configuration, or close to it, at
# every large batch of the H100 sweep (kernel_bench --sweep, GPT-2 heads, fp16).
DEFAULT_DECODE_CONFIG = DecodeConfig(block_n=64, num_warps=2)


def choose_num_splits(num_seqs: int, num_heads: int, max_seqlen_k: int, num_sms: int) -> int:
    """Split-KV factor for the decode path: splits until the launch has
    SPLIT_BELOW_PROGRAMS_PER_SM programs per SM, only for contexts of MIN_CONTEXT_TO_SPLIT
    keys or more and at most one split per MIN_KEYS_PER_SPLIT keys."""
    programs = num_seqs * num_heads
    target = SPLIT_BELOW_PROGRAMS_PER_SM * num_sms
    if programs >= target or max_seqlen_k < MIN_CONTEXT_TO_SPLIT:
        return 1
    wanted = triton.cdiv(target, programs)
    return max(1, min(wanted, max_seqlen_k // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


@triton.jit
def _prefill_tile(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, dims, dim_mask, q_pos, seq_len,
    start, qk_scale, cache_stride_b, cache_stride_s, cache_stride_h, block_size,
    key_ptr, value_ptr, kv_stride_t, kv_stride_h, context, q_start,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, NEW_KV: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N-key step of the online softmax (base 2: qk_scale includes log2(e)).
    MASKED tiles may hold keys past seq_len or after a query's own position; the others
    are wholly visible to every query of the tile and skip the masks. NEW_KV: keys from
    position `context` on are this step's, read from key_ptr/value_ptr (token row
    q_start + position - context), not from the cache."""
    cols = start + tl.arange(0, BLOCK_N)
    col_mask = cols < seq_len
    cached = col_mask
    if NEW_KV:
        cached = cols < context
    blocks = tl.load(table + cols // block_size, mask=cached, other=0).to(tl.int64)
    slots = blocks * cache_stride_b + (cols % block_size).to(tl.int64) * cache_stride_s
    kv_offsets = slots[:, None] + kv_head * cache_stride_h + dims[None, :]
    kv_mask = cached[:, None] & dim_mask[None, :]
    # other=0: slots past seq_len in a partial block may hold anything, NaN included.
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if NEW_KV:
        new = (cols >= context) & col_mask
        new_rows = (q_start + cols - context).to(tl.int64)
        new_offsets = new_rows[:, None] * kv_stride_t + kv_head * kv_stride_h + dims[None, :]
        new_mask = new[:, None] & dim_mask[None, :]
        k = tl.where(new_mask, tl.load(key_ptr + new_offsets, mask=new_mask, other=0.0), k)
        v = tl.where(new_mask, tl.load(value_ptr + new_offsets, mask=new_mask, other=0.0), v)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    if MASKED:
        visible = (cols[None, :] <= q_pos[:, None]) & col_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:  # noqa: SIM108 -- a constexpr branch, resolved at compile time
        # A row that has seen no key yet keeps m = -inf; subtracting it would give NaN.
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.exp2(s - m_new_safe[:, None])
    alpha = tl.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


# A mixed batch's tl.dot launch reads these from `num_decodes` rows in: their 16-byte
# alignment changes with it, and Triton would compile a variant for each while serving.
# They are read a scalar (or a few repeated block ids) at a time, so alignment buys nothing.
# Likewise the block table's row stride, its width in blocks, which follows the step's
# longest sequence (Triton specializes integers equal to 1 or divisible by 16): each
# variant would be compiled while serving, stalling every stream the first time.
@triton.jit(
    do_not_specialize=["bt_stride_s"],
    do_not_specialize_on_alignment=[
        "block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr", "slot_ptr"
    ],
)  # fmt: skip
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    key_ptr, value_ptr, slot_ptr,
    qk_scale,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h, kv_stride_t, kv_stride_h,
    cache_stride_b, cache_stride_s, cache_stride_h, bt_stride_s, block_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_SIZE: tl.constexpr, STORE_NEW_KV: tl.constexpr,
):  # fmt: skip
    """The tl.dot path: program (seq, head, tile) computes BLOCK_M queries of one head.

    STORE_NEW_KV: the step's keys and values (token rows of key_ptr/value_ptr, like q's) are
    not in the cache yet. Every program reads them from there, and the program of a K/V
    head's first query head writes its tile's rows to slot_ptr's slots (-1: nothing). No
    program of the launch reads those slots from the cache, so no separate store has to
    come first."""
    seq = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP_SIZE
    # The grid's last axis is launched last: reversed, the tiles with the most keys (the
    # causal diagonal's far end) start first and the short ones fill the tail.
    tile = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return  # a shorter sequence of the batch: this tile has no query
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # query i sits at absolute position context + i
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * q_stride_t + head * q_stride_h + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    q_pos = context + rows
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride_s
    # Keys before the tile's first query position are visible to all its queries (and all
    # exist): no masks there. The rest, up to the last query's position, are masked.
    first_pos = context + tile * BLOCK_M
    unmasked_end = (first_pos // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_M)
    for start in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, dims, dim_mask, q_pos,
            seq_len, start, qk_scale, cache_stride_b, cache_stride_s, cache_stride_h,
            block_size, key_ptr, value_ptr, kv_stride_t, kv_stride_h, context, q_start,
            BLOCK_N=BLOCK_N, MASKED=False, NEW_KV=STORE_NEW_KV,
        )  # fmt: skip
    for start in range(unmasked_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, dims, dim_mask, q_pos,
            seq_len, start, qk_scale, cache_stride_b, cache_stride_s, cache_stride_h,
            block_size, key_ptr, value_ptr, kv_stride_t, kv_stride_h, context, q_start,
            BLOCK_N=BLOCK_N, MASKED=True, NEW_KV=STORE_NEW_KV,
        )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * o_stride_t + head * o_stride_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )
    if STORE_NEW_KV:  # noqa: SIM102 -- a compile-time branch around a runtime one
        if head % GROUP_SIZE == 0:
            slots = tl.load(slot_ptr + q_rows, mask=row_mask, other=-1)
            src = q_rows[:, None] * kv_stride_t + kv_head * kv_stride_h + dims[None, :]
            dst = (
                (slots // block_size)[:, None] * cache_stride_b
                + (slots % block_size)[:, None] * cache_stride_s
                + kv_head * cache_stride_h
                + dims[None, :]
            )
            store_mask = (slots >= 0)[:, None] & dim_mask[None, :]
            tl.store(k_cache_ptr + dst, tl.load(key_ptr + src, mask=store_mask), mask=store_mask)
            tl.store(v_cache_ptr + dst, tl.load(value_ptr + src, mask=store_mask), mask=store_mask)


# The block table's row stride and the split count change with the step: not specialized
# (see _prefill_kernel).
@triton.jit(do_not_specialize=["num_splits", "bt_stride_s"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_stats_ptr,
    block_tables_ptr, seq_lens_ptr, key_ptr, value_ptr, slot_ptr,
    qk_scale, num_splits,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h, kv_stride_t, kv_stride_h,
    cache_stride_b, cache_stride_s, cache_stride_h, bt_stride_s, block_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, GROUP_SIZE: tl.constexpr, STORE_NEW_KV: tl.constexpr,
):  # fmt: skip
    """One query per sequence: a GEMV, so no tl.dot (a 16-row MMA tile would waste 15 rows).
    Split `split` of `num_splits` covers an equal, BLOCK_N-aligned share of the keys.

    STORE_NEW_KV: the sequence's last key (position seq_len - 1, this step's) is not in the
    cache yet. The split that covers it reads it from key_ptr/value_ptr instead, and the
    program of its K/V head's first query head writes it to slot_ptr's slot (-1: padding,
    nothing written): no program of the launch reads that slot, so no separate store has
    to come first."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1)
    kv_head = head // GROUP_SIZE
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(seq_len, start + per_split)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * q_stride_t + head * q_stride_h + dims, mask=dim_mask, other=0.0)
    q = q.to(tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * bt_stride_s
    last = seq_len - 1
    cached_end = end
    if STORE_NEW_KV:
        cached_end = tl.minimum(end, last)
    first_cols = start + tl.arange(0, BLOCK_N)
    blocks = tl.load(table + first_cols // block_size, mask=first_cols < cached_end, other=0)
    for block_start in range(start, cached_end, BLOCK_N):
        cols = block_start + tl.arange(0, BLOCK_N)
        col_mask = cols < cached_end
        # The next tile's block ids are asked for before this tile's keys are waited on, so
        # that the two reads overlap rather than chain (each tile's keys need its ids).
        next_cols = cols + BLOCK_N
        next_blocks = tl.load(table + next_cols // block_size, mask=next_cols < cached_end, other=0)
        slots = (
            blocks.to(tl.int64) * cache_stride_b + (cols % block_size).to(tl.int64) * cache_stride_s
        )
        kv_offsets = slots[:, None] + kv_head * cache_stride_h + dims[None, :]
        kv_mask = col_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * qk_scale
        s = tl.where(col_mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
        blocks = next_blocks
    if STORE_NEW_KV:  # noqa: SIM102 -- a compile-time branch around a runtime one
        if (start <= last) & (last < end):
            new = seq * kv_stride_t + kv_head * kv_stride_h + dims
            key = tl.load(key_ptr + new, mask=dim_mask, other=0.0)
            value = tl.load(value_ptr + new, mask=dim_mask, other=0.0)
            s_new = tl.sum(key.to(tl.float32) * q, axis=0) * qk_scale
            m_new = tl.maximum(m_i, s_new)  # finite: s_new is
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha + p_new * value.to(tl.float32)
            m_i = m_new
            slot = tl.load(slot_ptr + seq)
            if (slot >= 0) & (head % GROUP_SIZE == 0):
                dst = (
                    (slot // block_size) * cache_stride_b
                    + (slot % block_size) * cache_stride_s
                    + kv_head * cache_stride_h
                    + dims
                )
                tl.store(k_cache_ptr + dst, key, mask=dim_mask)
                tl.store(v_cache_ptr + dst, value, mask=dim_mask)
    if WRITE_PARTIAL:
        # fp32 partials: unnormalised acc, and (max, sum) for the reduce.
        part = (seq * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + part * HEAD_DIM + dims, acc, mask=dim_mask)
        tl.store(part_stats_ptr + part * 2, m_i)
        tl.store(part_stats_ptr + part * 2 + 1, l_i)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(
            out_ptr + seq * o_stride_t + head * o_stride_h + dims,
            out.to(out_ptr.dtype.element_ty),
            mask=dim_mask,
        )


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    part_out_ptr, part_stats_ptr, out_ptr, num_splits, o_stride_t, o_stride_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, SPLITS)
    split_mask = splits < num_splits
    parts = (seq * num_heads + head) * num_splits + splits
    m = tl.load(part_stats_ptr + parts * 2, mask=split_mask, other=float("-inf"))
    l = tl.load(part_stats_ptr + parts * 2 + 1, mask=split_mask, other=0.0)  # noqa: E741
    m_max = tl.max(m, axis=0)  # split 0 always has keys: finite
    weights = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # maxima in base 2
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    acc = tl.load(
        part_out_ptr + parts[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    out = tl.sum(weights[:, None] * acc, axis=0) / tl.sum(weights * l, axis=0)
    tl.store(
        out_ptr + seq * o_stride_t + head * o_stride_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere): the split-KV heuristic's input."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _check_new_kv(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(key, value, slot_mapping) checked against q and the cache, or None without them."""
    if key is None and value is None and slot_mapping is None:
        return None
    if key is None or value is None or slot_mapping is None:
        raise ValueError("key, value and slot_mapping come together")
    expected = (q.shape[0], *k_cache.shape[2:])
    if key.shape != expected or value.shape != expected:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must be {expected}"
        )
    if key.stride() != value.stride() or key.stride(2) != 1:
        raise ValueError("key and value must share strides, head_dim contiguous")
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise ValueError(f"dtype mismatch: key {key.dtype}, cache {k_cache.dtype}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (q.shape[0],):
        raise ValueError(f"slot_mapping must be int64 [{q.shape[0]}]")
    return key, value, slot_mapping


def _check(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out) -> None:
    num_tokens, num_heads, head_dim = q.shape
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads or k_cache.shape[3] != head_dim or k_cache.dtype != q.dtype:
        raise ValueError(
            f"cache {tuple(k_cache.shape)} {k_cache.dtype} does not match q "
            f"{tuple(q.shape)} {q.dtype} (K/V heads must divide the query heads)"
        )
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("head_dim must be the contiguous dimension")
    for name, t in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("cu_seqlens_q", cu_seqlens_q),
    ):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError("block_tables, seq_lens and cu_seqlens_q disagree on the batch size")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    out: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    num_decodes: int = 0,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    prefill: PrefillConfig | None = None,
    decode: DecodeConfig | None = None,
) -> torch.Tensor:
    """out[t] = causal softmax(q[t] K^T * scale) V over each sequence's paged keys.

    q, out: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim], num_kv_heads dividing num_heads (query head h reads K/V head
    h // (num_heads // num_kv_heads)); block_tables int32 [num_seqs, max_blocks]; seq_lens
    int32 [num_seqs] (keys after this step, context included); cu_seqlens_q int32
    [num_seqs + 1]. A batch with max_seqlen_q == 1 takes the decode path (split-KV over
    `num_splits`, chosen by choose_num_splits when None). In any other, the leading
    `num_decodes` sequences, which must have one query token each, take the decode path
    too, and the rest the tl.dot path, which gives a one-token query a whole tile of rows.
    `prefill` and `decode` override the launch heuristics (prefill_config and
    DEFAULT_DECODE_CONFIG).

    With `key`, `value` [num_tokens, num_kv_heads, head_dim] (one strides; the last dim
    contiguous) and `slot_mapping` int64 [num_tokens], the step's own keys and values are
    not in the cache yet: the kernels read them from `key`/`value` and write them to their
    slots (slot -1: nothing), as store_kv_ref would, with no launch of their own.
    Without them the cache already holds every key.
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out)
    new_kv = _check_new_kv(q, k_cache, key, value, slot_mapping)
    num_tokens = q.shape[0]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return out
    if max_seqlen_q == 1:
        if num_tokens != num_seqs:
            raise ValueError("a decode batch (max_seqlen_q == 1) has one token per sequence")
        num_decodes = num_seqs
    elif not 0 <= num_decodes < num_seqs:
        raise ValueError(f"num_decodes must be in [0, {num_seqs}) with longer queries")
    # The decodes' rows lead: one token each, so their tokens are rows [0, num_decodes).
    decode_rows, rest = slice(0, num_decodes), slice(num_decodes, None)
    if num_decodes:
        decode_kv = None
        if new_kv is not None:
            new_key, new_value, new_slots = new_kv
            decode_kv = (new_key[decode_rows], new_value[decode_rows], new_slots[decode_rows])
        _decode(
            q[decode_rows], k_cache, v_cache, block_tables[decode_rows], seq_lens[decode_rows],
            max_seqlen_k, out[decode_rows], scale, num_splits, decode or DEFAULT_DECODE_CONFIG,
            decode_kv,
        )  # fmt: skip
    if num_decodes < num_seqs:
        # The tl.dot path over the other sequences: cu_seqlens_q's offsets stay those of
        # the whole batch, so q and out are passed whole.
        _prefill(
            q, k_cache, v_cache, block_tables[rest], seq_lens[rest], cu_seqlens_q[rest],
            max_seqlen_q, out, scale, prefill or prefill_config(q.shape[2], q.dtype), new_kv,
        )  # fmt: skip
    return out


def _softmax_scale(scale: float) -> float:
    # The kernels' online softmax runs in base 2 (exp2 is one instruction): fold log2(e) in.
    return scale * LOG2_E


def _cache_args(k_cache: torch.Tensor, block_tables: torch.Tensor) -> tuple[int, ...]:
    return (
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        k_cache.shape[1],
    )


def _prefill(
    q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, out, scale,
    tiles: PrefillConfig, new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:  # fmt: skip
    """The tl.dot path over the sequences of block_tables/seq_lens/cu_seqlens_q, whose
    offsets index q, out and `new_kv` (key, value, slot_mapping: every token row's, the
    sequences' this step's keys, not in the cache yet) whole."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    grid = (seq_lens.shape[0], num_heads, triton.cdiv(max_seqlen_q, tiles.block_m))
    # Without new keys the kernel never reads these pointers: any tensors do.
    key, value, slots = new_kv or (q, q, seq_lens)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, key, value, slots,
        _softmax_scale(scale), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key.stride(0), key.stride(1), *_cache_args(k_cache, block_tables),
        HEAD_DIM=head_dim, BLOCK_D=max(triton.next_power_of_2(head_dim), MIN_DOT_DIM),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, GROUP_SIZE=num_heads // k_cache.shape[2],
        STORE_NEW_KV=new_kv is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def _decode(
    q, k_cache, v_cache, block_tables, seq_lens, max_seqlen_k, out, scale,
    num_splits: int | None, launch: DecodeConfig,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:  # fmt: skip
    """One query token per sequence: q and out [num_seqs, num_heads, head_dim]; `new_kv`
    (key, value, slot_mapping): the sequences' last keys, not in the cache yet."""
    num_seqs, num_heads, head_dim = q.shape
    splits = num_splits or choose_num_splits(num_seqs, num_heads, max_seqlen_k, num_sms(q.device))
    partial = (
        torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        if splits > 1
        else out
    )
    stats = (
        torch.empty((num_seqs, num_heads, splits, 2), dtype=torch.float32, device=q.device)
        if splits > 1
        else out
    )
    block_d = triton.next_power_of_2(head_dim)
    # Without new keys the kernel never reads these pointers: any tensors do.
    key, value, slots = new_kv or (q, q, seq_lens)
    _decode_kernel[(num_seqs, num_heads, splits)](
        q, k_cache, v_cache, out, partial, stats, block_tables, seq_lens, key, value, slots,
        _softmax_scale(scale), splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key.stride(0), key.stride(1), *_cache_args(k_cache, block_tables),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=launch.block_n, WRITE_PARTIAL=splits > 1,
        GROUP_SIZE=num_heads // k_cache.shape[2], STORE_NEW_KV=new_kv is not None,
        num_warps=launch.num_warps,
    )  # fmt: skip
    if splits > 1:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            partial, stats, out, splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS=triton.next_power_of_2(splits),
        )  # fmt: skip


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    out: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    num_decodes: int = 0,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    prefill: PrefillConfig | None = None,
    decode: DecodeConfig | None = None,
) -> torch.Tensor:
    """The same contract, one sequence at a time in fp32 plain torch. Query heads are
    grouped by the K/V head they read: q [T, H, D] as [T, H_kv, G, D]. New keys and
    values are stored first (store_kv_ref)."""
    new_kv = _check_new_kv(q, k_cache, key, value, slot_mapping)
    if new_kv is not None:
        store_kv_ref(new_kv[0], new_kv[1], k_cache, v_cache, new_kv[2])
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    for s in range(seq_lens.shape[0]):
        q_start, q_end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        seq_len = int(seq_lens[s])
        context = seq_len - (q_end - q_start)
        positions = torch.arange(seq_len, device=q.device)
        blocks = block_tables[s, positions // block_size].long()
        keys = k_cache[blocks, positions % block_size].float()  # [seq_len, H_kv, D]
        values = v_cache[blocks, positions % block_size].float()
        query = q[q_start:q_end].float().reshape(-1, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", query, keys) * scale
        query_pos = context + torch.arange(q_end - q_start, device=q.device)
        scores = scores.masked_fill(positions > query_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        attended = torch.einsum("hgqk,khd->qhgd", probs, values)  # [q_len, H_kv, G, D]
        out[q_start:q_end] = attended.reshape(-1, num_heads, head_dim).to(out.dtype)
    return out


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache[slot // block_size, slot % block_size] = key[t] (and v_cache from value) for
    every token t whose slot is not -1: what the kernels store, in plain torch."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    k_cache[slots // block_size, slots % block_size] = key[keep]
    v_cache[slots // block_size, slots % block_size] = value[keep]
