"""store_kv and copy_blocks: bit-exact against their torch twins, nothing else touched."""

import pytest
import torch

from octavo.kernels.copy_blocks import copy_blocks, copy_blocks_ref
from octavo.kernels.store_kv import store_kv, store_kv_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_store_kv_from_strided_views_skips_padding_slots(dtype):
    generator = torch.Generator().manual_seed(0)
    num_tokens, heads, dim, block_size, blocks = 7, 3, 16, 4, 6
    fused = torch.randn(num_tokens, 3, heads, dim, generator=generator).to(dtype)
    key, value = fused[:, 1], fused[:, 2]  # strided views, like the c_attn split
    slots = torch.tensor([5, 0, -1, 13, 22, -1, 9], dtype=torch.int64)
    k_cache = torch.randn(blocks, block_size, heads, dim, generator=generator).to(dtype)
    v_cache = torch.randn(blocks, block_size, heads, dim, generator=generator).to(dtype)
    original_k = k_cache.clone()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, expected_k, expected_v, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    flat = k_cache.view(-1, heads, dim)
    assert torch.equal(flat[13], key[3]) and torch.equal(flat[22], key[4])
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[[5, 0, 13, 22, 9]] = False
    assert torch.equal(flat[untouched], original_k.view(-1, heads, dim)[untouched])


def test_store_kv_rejects_bad_inputs():
    key = torch.zeros(2, 2, 8)
    cache = torch.zeros(3, 4, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, key, cache, cache.clone(), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache"):
        store_kv(
            key,
            key,
            torch.zeros(3, 4, 3, 8),
            torch.zeros(3, 4, 3, 8),
            torch.zeros(2, dtype=torch.int64),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_copy_blocks_copies_all_layers_bit_exactly(dtype):
    generator = torch.Generator().manual_seed(1)
    cache = torch.randn(3, 2, 9, 4, 2, 16, generator=generator).to(dtype)
    # Poison one source with NaN and inf: a copy must move bits, not values.
    cache[1, 0, 2, 0, 0, :2] = torch.tensor([float("nan"), float("inf")]).to(dtype)
    mapping = torch.tensor([[2, 7], [4, 1], [2, 8]], dtype=torch.int64)
    original = cache.clone()
    expected = cache.clone()
    copy_blocks_ref(expected, mapping)
    copy_blocks(cache, mapping)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))  # bits, NaN too
    untouched = [b for b in range(9) if b not in (7, 1, 8)]
    assert torch.equal(
        cache[:, :, untouched].view(torch.uint8), original[:, :, untouched].view(torch.uint8)
    )
    copy_blocks(cache, torch.empty((0, 2), dtype=torch.int64))  # no pairs: a no-op
