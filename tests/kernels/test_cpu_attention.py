"""The CPU decode kernel against its torch twin (paged_attention_ref): float32 and bfloat16,
grouped and multi-query heads, GPT-2's head size (compiled for it) and another, few sequences
(a task per head) and many (a task per sequence), a strided query; unused cache slots hold
NaN, so a read past a sequence's keys shows."""

import pytest
import torch

from octavo.kernels import cpu_attention
from octavo.kernels.paged_attention import paged_attention_ref
from tests.kernels.paged_setup import make_batch
from tests.model.test_config_variants import torch_backend_attention

pytestmark = pytest.mark.skipif(not cpu_attention.load(), reason="no C++ compiler here")

BLOCK_SIZE = 4
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def key_slots(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, blocks * block_size] int64: the slot of each key position."""
    offsets = torch.arange(block_size)
    return (block_tables.long()[:, :, None] * block_size + offsets).flatten(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 16])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("num_seqs", [3, 40], ids=["few", "many"])
def test_decode_kernel_matches_the_reference(dtype, head_dim, num_kv_heads, num_seqs):
    seq_lens = [(7 * i) % 45 + 1 for i in range(num_seqs)]  # 1 to 45 keys
    batch = make_batch([1] * num_seqs, seq_lens, num_heads=4, head_dim=head_dim,
                       block_size=BLOCK_SIZE, dtype=dtype, num_kv_heads=num_kv_heads)  # fmt: skip
    expected = paged_attention_ref(*batch.args(), torch.empty_like(batch.q), batch.scale)
    # The query as the model passes it: a strided view of a wider projection.
    wide = torch.zeros(num_seqs, 3, 4, head_dim, dtype=dtype)
    wide[:, 1] = batch.q
    q = wide[:, 1]
    out = torch.empty_like(batch.q)
    k_flat = batch.k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = batch.v_cache.view(-1, num_kv_heads, head_dim)
    slots = key_slots(batch.block_tables, BLOCK_SIZE)
    cpu_attention.decode_attention(q, k_flat, v_flat, slots, batch.seq_lens, batch.scale, out)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("in_place", [True, False], ids=["kernel", "gathered"])
def test_torch_backend_decodes_match_the_reference_with_or_without_the_kernel(
    in_place, monkeypatch
):
    """Decodes beside a prefill chunk through the backend: by the kernel, or where it cannot
    be built by gathered keys and SDPA; the same attention either way."""
    if not in_place:
        monkeypatch.setattr(cpu_attention, "load", lambda: False)
    batch = make_batch([1, 1, 1, 6], [37, 1, 21, 30], num_heads=4, head_dim=16,
                       block_size=BLOCK_SIZE, dtype=torch.float32, num_kv_heads=2)  # fmt: skip
    expected = paged_attention_ref(*batch.args(), torch.empty_like(batch.q), batch.scale,
                                   num_decodes=3)  # fmt: skip
    got = torch_backend_attention(batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
