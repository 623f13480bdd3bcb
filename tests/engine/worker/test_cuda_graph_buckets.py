"""CUDA-graph batch buckets: every batch size up to the maximum has a bucket that fits it."""

import pytest

from octavo.engine.worker.cuda_graphs import batch_size_buckets


@pytest.mark.parametrize("max_batch", [1, 2, 3, 8, 9, 16, 17, 40, 256])
def test_buckets_cover_every_batch_size(max_batch):
    buckets = batch_size_buckets(max_batch)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch
    for size in range(1, max_batch + 1):
        smallest = next(b for b in buckets if b >= size)
        assert smallest - size < 16  # at most one bucket step of padding
        if size <= 16:  # small batches, where padding costs most: less than double
            assert smallest < 2 * size, (size, smallest)
