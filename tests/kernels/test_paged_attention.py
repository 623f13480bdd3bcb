"""paged_attention against its torch twin in the Triton interpreter (tiny shapes)."""

import pytest
import torch

from octavo.kernels import paged_attention as pa
from octavo.kernels.paged_attention import (
    MIN_KEYS_PER_SPLIT,
    DecodeConfig,
    PrefillConfig,
    choose_num_splits,
    paged_attention,
    paged_attention_ref,
)
from tests.kernels.paged_setup import make_batch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2}

CASES = {
    # name: (query_lens, seq_lens, block_size)
    "decode_only": ([1, 1, 1, 1], [9, 1, 16, 23], 4),
    "mixed": ([1, 7, 1, 12], [20, 7, 5, 30], 4),
    "chunked_prefill_with_context": ([9, 16], [33, 40], 8),
    "exact_block_multiples": ([8, 1], [16, 32], 8),
    "kv_len_1": ([1], [1], 4),
    "long_prompt_spanning_tiles": ([70], [70], 16),
    # Tiles past a short sequence's queries exit early; a later tile's keys before its first
    # query are read without masks, the rest masked, across a context of 50.
    "varlen_chunks_spanning_tiles": ([40, 3, 1], [90, 50, 17], 4),
}


def run(batch, fn, **kwargs):
    out = torch.empty_like(batch.q)
    return fn(*batch.args(), out, batch.scale, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference(case, dtype):
    query_lens, seq_lens, block_size = CASES[case]
    batch = make_batch(
        query_lens, seq_lens, num_heads=2, head_dim=32, block_size=block_size, dtype=dtype
    )
    expected = run(batch, paged_attention_ref)
    got = run(batch, paged_attention)
    assert not torch.isnan(got).any(), "NaN from unused (poisoned) cache slots leaked in"
    torch.testing.assert_close(
        got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_split_kv_gives_the_same_decode(num_splits):
    batch = make_batch(
        [1, 1, 1], [70, 3, 129], num_heads=2, head_dim=16, block_size=8, dtype=torch.float32, seed=1
    )
    expected = run(batch, paged_attention_ref)
    got = run(batch, paged_attention, num_splits=num_splits)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1], [40, 17]), ([5, 1], [21, 9])])
def test_physical_block_placement_does_not_matter(query_lens, seq_lens):
    batch = make_batch(
        query_lens, seq_lens, num_heads=2, head_dim=16, block_size=4, dtype=torch.float32, seed=2
    )
    baseline = run(batch, paged_attention)
    moved = run(batch.permuted(seed=3), paged_attention)
    torch.testing.assert_close(moved, baseline, atol=1e-6, rtol=1e-6)


def test_four_heads_and_strided_queries():
    batch = make_batch(
        [3, 1], [11, 6], num_heads=4, head_dim=16, block_size=2, dtype=torch.float32, seed=4
    )
    fused = torch.randn(batch.q.shape[0], 3, 4, 16)  # q as a view of a fused projection
    fused[:, 0] = batch.q
    batch.q = fused[:, 0]
    assert not batch.q.is_contiguous()
    torch.testing.assert_close(
        run(batch, paged_attention), run(batch, paged_attention_ref), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("num_splits", [1, 2])
def test_a_mixed_batchs_leading_decodes_take_the_decode_path(num_splits, monkeypatch):
    """Three decodes, then a chunk with context and a prompt: the decodes run on the decode
    path (split-KV included), the others on the tl.dot path, in one call."""
    launched = []

    def recording(path):
        def launch(q, *args, **kwargs):
            launched.append((path.__name__, q.shape[0]))
            return path(q, *args, **kwargs)

        return launch

    monkeypatch.setattr(pa, "_decode", recording(pa._decode))
    monkeypatch.setattr(pa, "_prefill", recording(pa._prefill))
    batch = make_batch(
        [1, 1, 1, 9, 16], [70, 3, 45, 33, 16], num_heads=2, head_dim=16, block_size=8,
        dtype=torch.float32, seed=6,
    )  # fmt: skip
    got = run(batch, paged_attention, num_splits=num_splits, num_decodes=3)
    torch.testing.assert_close(got, run(batch, paged_attention_ref), atol=1e-5, rtol=1e-5)
    # The decode path gets the three decodes' queries; the tl.dot path the whole q, whose
    # rows it finds through cu_seqlens_q.
    assert launched == [("_decode", 3), ("_prefill", 28)]
    with pytest.raises(ValueError, match="num_decodes"):
        run(batch, paged_attention, num_decodes=5)


def test_configs_refuse_tiles_the_gpu_compiler_rejects():
    with pytest.raises(ValueError, match="powers of 2"):
        PrefillConfig(block_m=8, block_n=64)
    with pytest.raises(ValueError, match="powers of 2"):
        PrefillConfig(block_m=64, block_n=48)
    with pytest.raises(ValueError, match="power of 2"):
        DecodeConfig(block_n=24)


@pytest.mark.parametrize(
    "prefill,decode",
    [
        (PrefillConfig(16, 16, num_warps=2, num_stages=2), DecodeConfig(16, num_warps=2)),
        (PrefillConfig(32, 16), DecodeConfig(32)),
        (PrefillConfig(16, 64, num_warps=8), DecodeConfig(128, num_warps=8)),
    ],
    ids=str,
)
def test_launch_configs_give_the_same_result(prefill, decode):
    """Every shape kernel_bench --sweep may time computes the reference's answer."""
    for query_lens, seq_lens in (([9, 16], [33, 40]), ([1, 1, 1], [70, 3, 45])):
        batch = make_batch(
            query_lens, seq_lens, num_heads=2, head_dim=16, block_size=8, dtype=torch.float32
        )
        got = run(batch, paged_attention, num_splits=2, prefill=prefill, decode=decode)
        torch.testing.assert_close(got, run(batch, paged_attention_ref), atol=1e-5, rtol=1e-5)


def test_split_heuristic_only_splits_long_contexts_on_an_underfilled_device():
    assert choose_num_splits(num_seqs=256, num_heads=12, max_seqlen_k=1024, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, num_heads=12, max_seqlen_k=128, num_sms=132) == 1
    splits = choose_num_splits(num_seqs=1, num_heads=12, max_seqlen_k=1024, num_sms=132)
    assert 1 < splits <= 1024 // MIN_KEYS_PER_SPLIT
    # Enough programs already (4 per SM): no reduce to pay for.
    assert choose_num_splits(num_seqs=64, num_heads=12, max_seqlen_k=1024, num_sms=132) == 1
    # A few programs per SM: split, but never below MIN_KEYS_PER_SPLIT keys per split.
    assert choose_num_splits(num_seqs=8, num_heads=12, max_seqlen_k=512, num_sms=132) == 6
    assert choose_num_splits(num_seqs=1, num_heads=12, max_seqlen_k=256, num_sms=132) == 4
    assert choose_num_splits(num_seqs=2, num_heads=12, max_seqlen_k=65536, num_sms=132) <= 16


def _take_new_kv(batch, num_padding: int = 0):
    """Moves every query token's own key and value out of the cache, as a step finds them
    before they are stored: into strided views of a fused projection, their cache slots
    poisoned with NaN. Returns (key, value, slot_mapping, the cache as it was); the last
    `num_padding` decode rows get slot -1 (a CUDA-graph padding row: nothing stored)."""
    block_size = batch.k_cache.shape[1]
    full_k, full_v = batch.k_cache.clone(), batch.v_cache.clone()
    num_tokens, (num_kv_heads, head_dim) = batch.q.shape[0], batch.k_cache.shape[2:]
    fused = torch.full((num_tokens, 3, num_kv_heads, head_dim), float("nan"), dtype=batch.q.dtype)
    slots = []
    for s in range(batch.seq_lens.shape[0]):
        q_start, q_end = int(batch.cu_seqlens_q[s]), int(batch.cu_seqlens_q[s + 1])
        context = int(batch.seq_lens[s]) - (q_end - q_start)
        for i, token in enumerate(range(q_start, q_end)):
            pos = context + i
            block, offset = int(batch.block_tables[s, pos // block_size]), pos % block_size
            fused[token, 1], fused[token, 2] = full_k[block, offset], full_v[block, offset]
            batch.k_cache[block, offset] = batch.v_cache[block, offset] = float("nan")
            slots.append(block * block_size + offset)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    if num_padding:
        slot_mapping[-num_padding:] = -1
    return fused[:, 1], fused[:, 2], slot_mapping, (full_k, full_v)


@pytest.mark.parametrize(
    "query_lens,seq_lens,num_decodes,num_splits",
    [
        ([1, 1, 1], [70, 3, 129], 3, 1),
        ([1, 1, 1], [70, 3, 129], 3, 4),  # the new key in a later split than the first
        ([1, 1, 9, 16], [1, 45, 33, 16], 2, 2),  # a first token's decode; chunks after
        ([1, 12], [20, 30], 0, None),  # a decode on the tl.dot path
        # A chunk of two tiles (fp32 tiles are 32 rows) after a context, and a whole prompt:
        # the tl.dot path reads its own keys from `key`, across tiles, and stores its rows.
        ([1, 40, 7], [50, 70, 7], 1, None),
    ],
)
@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["mha", "mqa"])
def test_the_steps_own_keys_are_stored_and_attended(
    query_lens, seq_lens, num_decodes, num_splits, num_kv_heads
):
    """Given the step's keys and values, both paths read a sequence's new keys from them,
    not from their (stale, here NaN) slots, and write them there: after the call the cache
    is the one storing them first would leave, and the output the reference's."""
    batch = make_batch(
        query_lens, seq_lens, num_heads=2, head_dim=16, block_size=8, dtype=torch.float32,
        seed=8, num_kv_heads=num_kv_heads,
    )  # fmt: skip
    key, value, slots, (full_k, full_v) = _take_new_kv(batch)
    expected = run(batch, paged_attention_ref, key=key, value=value, slot_mapping=slots)
    assert torch.equal(batch.k_cache.nan_to_num(7), full_k.nan_to_num(7))  # the ref stored
    batch.k_cache[slots // 8, slots % 8] = batch.v_cache[slots // 8, slots % 8] = float("nan")
    got = run(
        batch, paged_attention, num_splits=num_splits, num_decodes=num_decodes, key=key,
        value=value, slot_mapping=slots,
    )  # fmt: skip
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(batch.k_cache.nan_to_num(7), full_k.nan_to_num(7))
    assert torch.equal(batch.v_cache.nan_to_num(7), full_v.nan_to_num(7))


def test_a_padding_prefill_row_stores_nothing():
    """A prefill row with slot -1 (padding) leaves its slot alone; the others are stored."""
    batch = make_batch(
        [1, 6], [9, 6], num_heads=2, head_dim=16, block_size=4, dtype=torch.float32, seed=10
    )
    key, value, slots, (full_k, full_v) = _take_new_kv(batch, num_padding=1)
    run(batch, paged_attention, num_decodes=1, key=key, value=value, slot_mapping=slots)
    stored, padding = slots[:-1], batch.block_tables[1, 5 // 4] * 4 + 5 % 4
    assert torch.equal(batch.k_cache[stored // 4, stored % 4], full_k[stored // 4, stored % 4])
    assert torch.equal(batch.v_cache[stored // 4, stored % 4], full_v[stored // 4, stored % 4])
    assert torch.isnan(batch.k_cache[padding // 4, padding % 4]).all()


def test_a_padding_decode_row_stores_nothing():
    batch = make_batch(
        [1, 1], [9, 5], num_heads=2, head_dim=16, block_size=4, dtype=torch.float32, seed=9
    )
    key, value, slots, (full_k, _) = _take_new_kv(batch, num_padding=1)
    padding_slot = batch.block_tables[1, 4 // 4] * 4  # position 4 of sequence 1
    run(batch, paged_attention, key=key, value=value, slot_mapping=slots)
    stored = batch.k_cache[slots[0] // 4, slots[0] % 4]
    assert torch.equal(stored, full_k[slots[0] // 4, slots[0] % 4])
    assert torch.isnan(batch.k_cache[padding_slot // 4, padding_slot % 4]).all()


def test_new_keys_come_with_their_slots():
    batch = make_batch([1], [5], num_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    key = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="come together"):
        run(batch, paged_attention, key=key, value=key)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        slots = torch.zeros(1, dtype=torch.int32)
        run(batch, paged_attention, key=key, value=key, slot_mapping=slots)
