"""The GPU's LoRA kernels (kernels/lora.py, the interpreter on CPU) against their torch twin
add_lora_ref: rows of three slots and of none in any order, a rank and widths the blocks
mask, a strided x; and the shape checks."""

import pytest
import torch

from octavo.engine.worker.lora import add_lora_ref
from octavo.kernels.lora import add_lora

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
# Compiled on a GPU; the interpreter (tests/conftest.py) on a CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    ("in_features", "out_features", "rank"), [(64, 128, 16), (100, 72, 24)],
    ids=["whole_blocks", "masked_blocks"],
)  # fmt: skip
def test_add_lora_is_its_torch_twin(dtype, in_features, out_features, rank):
    generator = torch.Generator().manual_seed(in_features)
    slots = torch.tensor([2, -1, 0, 2, 1, -1, 0], dtype=torch.long)
    wide = torch.randn(len(slots), in_features + 5, generator=generator).to(dtype)
    x = wide[:, 5:]
    lora_a = (torch.randn(3, in_features, rank, generator=generator) / in_features**0.5).to(dtype)
    lora_b = torch.randn(3, rank, out_features, generator=generator).to(dtype)
    out = torch.randn(len(slots), out_features, generator=generator).to(dtype)
    want = out.to(torch.float32, copy=True)
    add_lora_ref(want, x.float(), lora_a.float(), lora_b.float(), slots)
    before = out.clone()
    on_device = [t.to(DEVICE) for t in (out, x, lora_a, lora_b, slots)]
    add_lora(*on_device)
    out = on_device[0].cpu()
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), want, atol=tolerance * 4, rtol=tolerance)
    assert torch.equal(out[slots < 0], before[slots < 0])


def test_rejects_shapes_that_do_not_chain():
    out, x = torch.zeros(2, 8), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="do not make"):
        add_lora(
            out, x, torch.zeros(1, 5, 16), torch.zeros(1, 16, 8), torch.zeros(2, dtype=torch.long)
        )
