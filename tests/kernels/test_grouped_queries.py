"""Grouped queries (multi-query attention): several query heads reading one K/V head, in
paged_attention against its torch twin (Triton interpreter, tiny shapes), the torch backend,
and store_kv from a multi-query projection."""

import pytest
import torch

from octavo.kernels.paged_attention import DecodeConfig, paged_attention, paged_attention_ref
from octavo.kernels.store_kv import store_kv, store_kv_ref
from tests.kernels.paged_setup import PagedBatch, make_batch
from tests.model.test_config_variants import torch_backend_attention

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


def test_store_kv_from_the_multi_query_projection():
    """k and v as GPTBigCode's multi-query c_attn gives them: [T, 1, D] strided views of
    [T, n_embd + 2 D]."""
    generator = torch.Generator().manual_seed(0)
    num_tokens, num_blocks = 5, 4
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2) * HEAD_DIM, generator=generator)
    key = qkv[:, None, NUM_HEADS * HEAD_DIM : (NUM_HEADS + 1) * HEAD_DIM]
    value = qkv[:, None, (NUM_HEADS + 1) * HEAD_DIM :]
    slots = torch.tensor([6, -1, 0, 13, 9], dtype=torch.int64)
    shape = (num_blocks, BLOCK_SIZE, 1, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, expected_k, expected_v, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert torch.equal(v_cache.view(-1, HEAD_DIM)[13], value[3, 0])
