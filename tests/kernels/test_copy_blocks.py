"""copy_blocks: bit-exact against its torch twin, nothing else touched."""

import pytest
import torch

from octavo.kernels.copy_blocks import copy_blocks, copy_blocks_ref


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
