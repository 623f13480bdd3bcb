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
