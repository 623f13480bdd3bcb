"""The padded static decode batch that full CUDA graphs replay, checked on CPU with each
bucket's step run op by op: everything of the graph path except the capture itself (tested on
a GPU in test_gpu_engine)."""

import numpy as np
import pytest
import torch

from octavo.engine import EngineConfig, LLMEngine
from octavo.engine.worker.cuda_graphs import DecodeGraphs, DecodeInputBuffers, forward_bucket
from octavo.engine.worker.cudagraph_dispatcher import CudagraphDispatcher
from octavo.engine.worker.input_batch import HostBatch, PendingInputs
from octavo.kernels.paged_attention import MIN_CONTEXT_TO_SPLIT
from tests.checkpoints import sample_prompts
from tests.engine.helpers import assert_hf_greedy, run_to_completion, staggered_greedy

# An H100's multiprocessor count and the shortest max_model_len that splits: the buckets'
# fixed split-KV factor is then > 1, as on the GPU. Longer contexts only add interpreted
# split programs.
H100_SMS = 132
BUFFER_MAX_MODEL_LEN = MIN_CONTEXT_TO_SPLIT


class RecordingDecodeGraphs(DecodeGraphs):
    """Decode graphs not captured (each bucket's step run op by op), with each step's
    (rows, bucket) recorded."""

    def __init__(self, engine: LLMEngine, max_batch_size: int):
        runner = engine.runner
        super().__init__(
            runner.model, runner.kv_cache, max_batch_size, BUFFER_MAX_MODEL_LEN,
            engine.config.block_size, capture=False,
        )  # fmt: skip
        self.buffers.num_sms = H100_SMS
        self.replays: list[tuple[int, int]] = []  # (rows, bucket)

    def run(self, batch: HostBatch, pending: PendingInputs | None) -> torch.Tensor:
        hidden = super().run(batch, pending)
        self.replays.append((batch.num_seqs, self.buffers.bucket(batch.num_seqs)))
        return hidden


def triton_engine(model_dir: str) -> LLMEngine:
    config = EngineConfig(
        model=model_dir,
        device="cpu",
        dtype="float32",
        num_blocks=96,
        block_size=8,
        attention_backend="triton",
    )
    return LLMEngine(config)


def test_padded_bucket_replay_gives_hf_greedy_tokens(tiny_model_dir, hf_tiny):
    """Sequences finish one after another, so the decode batch shrinks through buckets 8, 4,
    2, 1 with padding rows, over buffers holding stale rows and columns of wider batches."""
    engine = triton_engine(tiny_model_dir)
    replay = RecordingDecodeGraphs(engine, max_batch_size=8)
    engine.runner.dispatcher = CudagraphDispatcher(full=replay)
    prompts = sample_prompts(5, 3, 40, hf_tiny.config.vocab_size, seed=3)
    params = staggered_greedy(5, first=2, step=2)
    assert_hf_greedy(hf_tiny, prompts, params, run_to_completion(engine, prompts, params))
    assert {size for _, size in replay.replays} >= {8, 4, 2, 1}
    assert any(rows < size for rows, size in replay.replays)  # padding rows were replayed
    assert replay.buffers.metadata(8).decode_num_splits > 1


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_padding_rows_store_nothing(tiny_model_dir, rows):
    """Only the real rows' slots change; padding rows write nowhere, the null block stays 0.
    (On the engine's device: `--engine-device cuda` runs it on a GPU.)"""
    engine = triton_engine(tiny_model_dir)
    kv_cache = engine.runner.kv_cache
    generator = torch.Generator().manual_seed(rows)
    kv_cache[:, :, 1:] = torch.randn(kv_cache[:, :, 1:].shape, generator=generator).to(kv_cache)
    before = kv_cache.clone()
    buffers = DecodeInputBuffers(8, BUFFER_MAX_MODEL_LEN, 8, 4, kv_cache.device)
    tables = [[1 + 3 * r, 2 + 3 * r, 3 + 3 * r] for r in range(rows)]
    seq_lens = [17 + r for r in range(rows)]  # the new token lands in each table's 3rd block
    slots = [t[2] * 8 + (n - 1) % 8 for t, n in zip(tables, seq_lens, strict=True)]
    size = buffers.load(
        np.arange(rows), np.array(seq_lens) - 1, np.array(slots), np.array(tables),
        np.array(seq_lens),
    )  # fmt: skip
    assert size == buffers.bucket(rows) and size >= rows
    hidden = forward_bucket(engine.runner.model, kv_cache, buffers, size)
    assert torch.isfinite(hidden).all()
    changed = (kv_cache != before).flatten(4).any(-1).any(0).any(0)  # [blocks, block_size]
    written = torch.zeros_like(changed)
    for slot in slots:
        written[slot // 8, slot % 8] = True
    assert torch.equal(changed, written)
    assert not kv_cache[:, :, 0].any()
