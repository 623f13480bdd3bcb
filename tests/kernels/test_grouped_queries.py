"""Grouped queries (multi-query attention): several query heads reading one K/V head, in
paged_attention against its torch twin (Triton interpreter, tiny shapes), the torch backend,
and the step's keys stored from a multi-query projection."""

import pytest
import torch

from octavo.kernels.paged_attention import DecodeConfig, paged_attention, paged_attention_ref
from tests.engine.worker.models.test_config_variants import torch_backend_attention
from tests.kernels.paged_setup import PagedBatch, make_batch

NUM_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 16, 4
TOLERANCE = 1e-5
CASES = {
    # name: (query_lens, seq_lens); decodes take the decode kernel, split in two
    "decode": ([1, 1, 1], [37, 3, 21]),
    "prefill_chunks_and_decodes": ([1, 7, 12], [20, 7, 30]),
}
# 16 keys per iteration: two splits of a 37-key context both hold keys.
DECODE = DecodeConfig(block_n=16)
NUM_SPLITS = 2


def grouped_batch(case: str, num_kv_heads: int) -> PagedBatch:
    query_lens, seq_lens = CASES[case]
    return make_batch(
        query_lens, seq_lens, num_heads=NUM_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
        dtype=torch.float32, num_kv_heads=num_kv_heads,
    )  # fmt: skip


def attend(batch: PagedBatch, fn, **kwargs) -> torch.Tensor:
    return fn(*batch.args(), torch.empty_like(batch.q), batch.scale, **kwargs)


@pytest.mark.parametrize("num_kv_heads", [1, 2], ids=["one_kv_head", "two_kv_heads"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_and_torch_backend_match_the_reference(case, num_kv_heads):
    batch = grouped_batch(case, num_kv_heads)
    expected = attend(batch, paged_attention_ref)
    got = attend(batch, paged_attention, num_splits=NUM_SPLITS, decode=DECODE)
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
    torch_backend = torch_backend_attention(batch)
    torch.testing.assert_close(torch_backend, expected, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_reference_is_attention_over_kv_heads_repeated_per_query_head(num_kv_heads):
    """The twin's grouping is the definition: query head h attends to K/V head h // G, as
    ungrouped attention over K/V repeated G times per head (what no kernel may do) would."""
    batch = grouped_batch("prefill_chunks_and_decodes", num_kv_heads)
    group = NUM_HEADS // num_kv_heads
    repeated = PagedBatch(**vars(batch))
    repeated.k_cache = batch.k_cache.repeat_interleave(group, dim=2)
    repeated.v_cache = batch.v_cache.repeat_interleave(group, dim=2)
    torch.testing.assert_close(
        attend(batch, paged_attention_ref), attend(repeated, paged_attention_ref),
        atol=TOLERANCE, rtol=TOLERANCE,
    )  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_multi_query_projection_is_stored_and_attended(case):
    """k and v as GPTBigCode's multi-query c_attn gives them, [T, 1, D] strided views of
    [T, n_embd + 2 D], not in the cache yet: the kernels store them (one K/V head written
    once, whichever query heads read it) and attend to them as the reference does."""
    batch = grouped_batch(case, num_kv_heads=1)
    num_tokens = batch.q.shape[0]
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2) * HEAD_DIM, generator=generator)
    key = qkv[:, None, NUM_HEADS * HEAD_DIM : (NUM_HEADS + 1) * HEAD_DIM]
    value = qkv[:, None, (NUM_HEADS + 1) * HEAD_DIM :]
    slots = []
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        query_len = int(batch.cu_seqlens_q[s + 1] - batch.cu_seqlens_q[s])
        for pos in range(seq_len - query_len, seq_len):
            block = int(batch.block_tables[s, pos // BLOCK_SIZE])
            slots.append(block * BLOCK_SIZE + pos % BLOCK_SIZE)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    reference = PagedBatch(**{**vars(batch), "k_cache": batch.k_cache.clone(),
                              "v_cache": batch.v_cache.clone()})  # fmt: skip
    new_kv = {"key": key, "value": value, "slot_mapping": slot_mapping}
    expected = attend(reference, paged_attention_ref, **new_kv)
    # A mixed batch's leading decode on the decode kernel: both kernels store.
    num_decodes = 1 if batch.max_seqlen_q > 1 else 0
    got = attend(
        batch, paged_attention, decode=DECODE, num_splits=NUM_SPLITS, num_decodes=num_decodes,
        **new_kv,
    )  # fmt: skip
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
    # nan_to_num: make_batch fills the slots no sequence uses with NaN.
    assert torch.equal(batch.k_cache.nan_to_num(7), reference.k_cache.nan_to_num(7))
    assert torch.equal(batch.v_cache.nan_to_num(7), reference.v_cache.nan_to_num(7))
