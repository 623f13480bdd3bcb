"""Our GPT-2 on a GPU, Triton kernels and fused layer ops (add + LayerNorm, the GELU in the
matrix product's epilogue) included, against transformers on the CPU."""

import pytest
import torch

from octavo.engine.worker.attention.triton_backend import TritonAttentionBackend
from octavo.engine.worker.models.weights import load_model
from tests.checkpoints import make_checkpoint
from tests.model.test_gpt2_parity import SPECS, paged_logits

pytestmark = pytest.mark.gpu

# float32 on both sides (TF32 is off for matrix products by default): rounding only. The
# erf GELU in place of GPT-2's tanh one moves the logits by more.
FLOAT32_ATOL = 1e-4
# float16: relative to the logits' spread.
FLOAT16_RTOL = 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"L{s.n_layer}-C{s.n_embd}-H{s.n_head}")
def test_logits_on_gpu_match_transformers(tmp_path, spec, dtype):
    from transformers import GPT2LMHeadModel

    folder = make_checkpoint(tmp_path, spec)
    hf = GPT2LMHeadModel.from_pretrained(folder).eval()
    backend = TritonAttentionBackend()
    ours = load_model(folder, "auto", backend, torch.device("cuda"), dtype, seed=0).model
    tokens = torch.randint(
        0, spec.vocab_size, (min(spec.n_positions, 61),),
        generator=torch.Generator().manual_seed(spec.seed),
    ).tolist()  # fmt: skip
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    n = len(tokens)
    for chunks in ([n], [5, 1, 1, 20, n - 27], [1] * 3 + [n - 3]):
        got = paged_logits(ours, tokens, chunks, block_size=16, backend=backend).float()
        error = (got - expected).abs().max().item()
        if dtype == torch.float32:
            assert error < FLOAT32_ATOL, (chunks, error)
        else:
            assert error < FLOAT16_RTOL * expected.abs().max().item(), (chunks, error)
