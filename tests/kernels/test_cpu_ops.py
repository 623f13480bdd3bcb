"""The CPU's C++ operators against their torch twins. The decode kernel against
paged_attention_ref: float32 and bfloat16, grouped and multi-query heads, GPT-2's head size
(compiled for it) and another, few sequences (a task per head) and many (a task per
sequence), a strided query; unused cache slots hold NaN, so a read past a sequence's keys
shows. The int8 layer's row scaling against quantization.py's twins. The LoRA operator
against lora.py's add_lora_ref."""

import subprocess
import sys

import pytest
import torch

from octavo.engine.config import cpu_computes_int8
from octavo.engine.worker.lora import add_lora_ref
from octavo.engine.worker.models.quantization import (
    ZERO_POINT,
    Int8Linear,
    quantize_activations,
    rescale_rows_ref,
)
from octavo.kernels import cpu_ops
from octavo.kernels.paged_attention import paged_attention_ref
from tests.engine.worker.models.test_config_variants import torch_backend_attention
from tests.kernels.paged_setup import make_batch

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="no C++ compiler here")

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
    cpu_ops.decode_attention(q, k_flat, v_flat, slots, batch.seq_lens, batch.scale, out)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("in_place", [True, False], ids=["kernel", "gathered"])
def test_torch_backend_decodes_match_the_reference_with_or_without_the_kernel(
    in_place, monkeypatch
):
    """Decodes beside a prefill chunk through the backend: by the kernel, or where it cannot
    be built by gathered keys and SDPA; the same attention either way."""
    if not in_place:
        monkeypatch.setattr(cpu_ops, "load", lambda: False)
    batch = make_batch([1, 1, 1, 6], [37, 1, 21, 30], num_heads=4, head_dim=16,
                       block_size=BLOCK_SIZE, dtype=torch.float32, num_kv_heads=2)  # fmt: skip
    expected = paged_attention_ref(*batch.args(), torch.empty_like(batch.q), batch.scale,
                                   num_decodes=3)  # fmt: skip
    got = torch_backend_attention(batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_quantize_rows_is_its_torch_twin(dtype, rows):
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    x[0] = 0  # an all-zero row: a tiny scale, zeros
    x[-1] *= 50
    q, scale = cpu_ops.quantize_rows(x)
    q_ref, scale_ref = quantize_activations(x)
    assert q.dtype == q_ref.dtype == torch.uint8
    torch.testing.assert_close(scale, scale_ref, atol=0, rtol=1e-6)
    # x * (1 / scale) and x / scale may round a value at .5 apart: one step, rarely.
    assert (q.int() - q_ref.int()).abs().max() <= 1
    assert (q != q_ref).float().mean() < 0.01
    assert (q[0] == ZERO_POINT).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_rescale_rows_is_its_torch_twin(dtype, bias):
    generator = torch.Generator().manual_seed(1)
    out = torch.randn(7, 33, generator=generator).to(dtype)
    scale = torch.rand(9, 1, generator=generator)  # more rows than out, as a padded batch's
    b = torch.randn(33, generator=generator).to(dtype) if bias else None
    want = out.clone()
    rescale_rows_ref(want, scale, b)
    cpu_ops.rescale_rows_(out, scale, b)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want, atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(not cpu_computes_int8(), reason="this CPU has no int8 units")
def test_int8_layer_without_the_operators_gives_the_same_product(monkeypatch):
    layer = torch.nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    fused = Int8Linear(layer)(x)
    monkeypatch.setattr(cpu_ops, "load", lambda: False)
    unfused = Int8Linear(layer)(x)
    torch.testing.assert_close(fused, unfused, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("in_features", "out_features", "rank"),
    [(64, 96, 16), (37, 200, 32), (48, 8, 16)],
    ids=["whole_tiles", "odd_input_column_tail", "columns_narrower_than_a_vector"],
)
def test_add_lora_is_its_torch_twin(dtype, in_features, out_features, rank):
    """Rows of three slots (one with more rows than a block), of no slot, in any order; x a
    strided view, as a projection's slice is."""
    generator = torch.Generator().manual_seed(in_features)
    slots = torch.tensor([2, -1, 0, 2, 2, 1, -1] + [0] * 12 + [2, 1], dtype=torch.long)
    wide = torch.randn(len(slots), 2 * in_features, generator=generator).to(dtype)
    x = wide[:, in_features:]
    lora_a = (torch.randn(3, in_features, rank, generator=generator) / in_features**0.5).to(dtype)
    lora_b = torch.randn(3, rank, out_features, generator=generator).to(dtype)
    out = torch.randn(len(slots), out_features, generator=generator).to(dtype)
    before = out.clone()
    want = out.to(torch.float32, copy=True)
    add_lora_ref(want, x.float(), lora_a.float(), lora_b.float(), slots)
    cpu_ops.add_lora_(out, x, lora_a, lora_b, slots)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tolerance * 4, rtol=tolerance)
    assert torch.equal(out[slots < 0], before[slots < 0])


def test_a_loader_killed_holding_torchs_lock_does_not_stop_later_loads():
    """A process killed while it loads the operators leaves torch's lock file in the build
    folder (as a server stopped while its engine starts does); the next load still returns,
    and removes it."""
    stale = cpu_ops.build_folder() / "lock"
    stale.write_text("-1")  # FileBaton's file, as a killed holder leaves it
    try:
        run = subprocess.run(
            [sys.executable, "-c", "from octavo.kernels import cpu_ops; assert cpu_ops.load()"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_another_install_of_the_sources_builds_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """A venv's installed package and a checkout, the same sources at two paths: ninja rebuilds
    a build whose sources moved, so sharing one folder would rebuild it on each one's first
    load (minutes, inside a server's startup)."""
    ours = cpu_ops.build_folder()
    copies = []
    for source in cpu_ops.SOURCES:
        copies.append(tmp_path / source.name)
        copies[-1].write_text(source.read_text())
    monkeypatch.setattr(cpu_ops, "SOURCES", copies)
    theirs = cpu_ops.build_folder()
    assert theirs != ours and theirs.parent == ours.parent
