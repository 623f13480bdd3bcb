"""The kernels at real GPT-2 sizes on a GPU: fp16 and bf16, long contexts, int64 addressing."""

import pytest
import torch

from octavo.kernels.copy_blocks import copy_blocks, copy_blocks_ref
from octavo.kernels.layer_norm import add_layer_norm, add_layer_norm_ref
from octavo.kernels.paged_attention import paged_attention, paged_attention_ref
from tests.kernels.paged_setup import make_batch

pytestmark = pytest.mark.gpu

HEAD_DIM = 64
BLOCK_SIZE = 16
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
LAYER_NORM_EPS = 1e-5


def far_batch(num_heads, query_lens, seq_lens, dtype, num_blocks):
    """A batch whose blocks sit at the top of a cache so large that element offsets pass
    2**31: any int32 address arithmetic would wrap."""
    device = "cuda"
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (num_blocks, BLOCK_SIZE, num_heads, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=dtype, device=device)
    v_cache = torch.empty(shape, dtype=dtype, device=device)
    per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    top = torch.arange(num_blocks - sum(per_seq), num_blocks, device=device)
    ids = top[torch.randperm(top.numel(), device=device, generator=generator)]
    k_cache[ids] = torch.randn(
        (ids.numel(), *shape[1:]), generator=generator, device=device, dtype=dtype
    )
    v_cache[ids] = torch.randn(
        (ids.numel(), *shape[1:]), generator=generator, device=device, dtype=dtype
    )
    tables, start = [], 0
    for count in per_seq:
        tables.append(ids[start : start + count].tolist())
        start += count
    width = max(per_seq)
    block_tables = torch.tensor(
        [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
    )
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    q = torch.randn((cu[-1], num_heads, HEAD_DIM), generator=generator, device=device, dtype=dtype)
    return (
        q,
        k_cache,
        v_cache,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.tensor(cu, dtype=torch.int32, device=device),
        max(query_lens),
        max(seq_lens),
    )


@pytest.mark.parametrize("num_heads", [12, 16, 20, 25])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", ["decode", "mixed"])
def test_paged_attention_real_sizes(num_heads, dtype, shape):
    num_blocks = max(32768, 2**31 // (BLOCK_SIZE * num_heads * HEAD_DIM) + 64)
    if shape == "decode":
        query_lens, seq_lens = [1] * 8, [1, 17, 128, 255, 512, 700, 1000, 1024]
    else:
        query_lens, seq_lens = [1, 300, 1, 64, 512], [1024, 300, 40, 900, 1024]
    args = far_batch(num_heads, query_lens, seq_lens, dtype, num_blocks)
    scale = HEAD_DIM**-0.5
    expected = paged_attention_ref(*args, torch.empty_like(args[0]), scale)
    # (num_splits, num_decodes): a mixed batch's leading decode on the tl.dot path (0) or
    # on the decode path (1), split or not.
    launches = [(None, 0), (1, 0), (4, 0)] if shape == "decode" else [(None, 0), (None, 1), (4, 1)]
    for splits, num_decodes in launches:
        got = paged_attention(
            *args, torch.empty_like(args[0]), scale, num_splits=splits, num_decodes=num_decodes
        )
        torch.testing.assert_close(
            got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
        )
    # As the engine launches it: the step's own keys and values given apart, their slots
    # poisoned, stored by the call (the decodes' inside the decode kernel).
    k_cache, v_cache = args[1].view(-1, num_heads, HEAD_DIM), args[2].view(-1, num_heads, HEAD_DIM)
    slots = own_slots(args[3], seq_lens, query_lens)
    key, value = k_cache[slots], v_cache[slots]
    k_cache[slots] = v_cache[slots] = float("nan")
    got = paged_attention(
        *args, torch.empty_like(args[0]), scale, num_decodes=launches[-1][1], key=key,
        value=value, slot_mapping=slots,
    )  # fmt: skip
    torch.testing.assert_close(
        got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )
    assert torch.equal(k_cache[slots], key) and torch.equal(v_cache[slots], value)


def own_slots(block_tables, seq_lens, query_lens) -> torch.Tensor:
    """The cache slots of every query token's own key: the last query_lens[s] positions."""
    table = block_tables.cpu()
    slots = [
        int(table[s, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
        for s, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True))
        for pos in range(seq_len - q_len, seq_len)
    ]
    return torch.tensor(slots, dtype=torch.int64, device=block_tables.device)


@pytest.mark.parametrize("head_dim", [4, 8, 24])
@pytest.mark.parametrize("shape", ["decode", "mixed"])
def test_paged_attention_head_dims_below_the_mma_minimum(head_dim, shape):
    """Head dims under tl.dot's minimum inner dimension (16) or not a power of two, as small
    GPTBigCode and GPT-2 configurations have: the compiled kernels, not the interpreter, are
    the ones that refuse narrow dots."""
    query_lens = [1, 1, 1] if shape == "decode" else [1, 37, 5]
    batch = make_batch(
        query_lens, [90, 40, 17], num_heads=4, head_dim=head_dim, block_size=BLOCK_SIZE,
        dtype=torch.float32, device="cuda", num_kv_heads=1,
    )  # fmt: skip
    expected = paged_attention_ref(*batch.args(), torch.empty_like(batch.q), batch.scale)
    got = paged_attention(*batch.args(), torch.empty_like(batch.q), batch.scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu_memory
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_copy_blocks_real_sizes(dtype):
    kv = torch.randn((12, 2, 4096, BLOCK_SIZE, 12, HEAD_DIM), dtype=dtype, device="cuda")
    mapping = torch.tensor([[5, 4000], [17, 9], [4095, 0]], dtype=torch.int64, device="cuda")
    expected = kv.clone()
    copy_blocks_ref(expected, mapping)
    copy_blocks(kv, mapping)
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("width", [768, 1600])  # GPT-2 small's and xl's
def test_add_layer_norm_real_sizes(dtype, width):
    generator = torch.Generator(device="cuda").manual_seed(width)
    x, residual = (
        torch.randn((300, width), generator=generator, device="cuda", dtype=dtype) for _ in range(2)
    )
    weight, bias = (
        torch.randn(width, generator=generator, device="cuda", dtype=dtype) for _ in range(2)
    )
    out, total = add_layer_norm(x, residual, weight, bias, LAYER_NORM_EPS)
    expected_out, expected_total = add_layer_norm_ref(x, residual, weight, bias, LAYER_NORM_EPS)
    assert torch.equal(total, expected_total)
    torch.testing.assert_close(
        out.float(), expected_out.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )
