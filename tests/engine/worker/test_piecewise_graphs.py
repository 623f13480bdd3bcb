"""Piecewise steps (every layer's work but attention from a per-bucket piece), checked on CPU
with the pieces run op by op: the padding and the cut around attention, everything of the
path but the capture itself (captured on a GPU in test_gpu_engine)."""

import pytest
import torch

from octavo.engine import EngineConfig, LLMEngine
from octavo.engine.worker.attention.backend import AttentionMetadata
from octavo.engine.worker.cudagraph_dispatcher import CudagraphDispatcher
from octavo.engine.worker.piecewise_graphs import PiecewiseGraphs, token_buckets
from tests.checkpoints import sample_prompts
from tests.engine.helpers import assert_hf_greedy, run_to_completion, staggered_greedy
from tests.engine.test_beam_search import assert_same, hf_beam_search, make_case

# A small step budget: prompts are prefilled in chunks beside other sequences' decodes.
STEP_TOKENS = 48


class RecordingPieces(PiecewiseGraphs):
    """The pieces run op by op, each step's (tokens, bucket) recorded."""

    def __init__(self, engine: LLMEngine):
        runner = engine.runner
        super().__init__(runner.model, runner.kv_cache, STEP_TOKENS, capture=False)
        self.steps: list[tuple[int, int]] = []

    def bucket(self, num_tokens: int) -> int:
        size = super().bucket(num_tokens)
        self.steps.append((num_tokens, size))
        return size


@pytest.mark.parametrize("max_num_tokens", [1, 100, 128, 300, 2048])
def test_token_buckets_hold_every_step_with_bounded_padding(max_num_tokens):
    buckets = token_buckets(max_num_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_num_tokens
    for num_tokens in range(1, max_num_tokens + 1):
        size = next(b for b in buckets if b >= num_tokens)
        # Padding at most doubles a small step and adds under 128 rows to a large one.
        assert size - num_tokens < max(num_tokens, 128)


def test_piecewise_steps_give_hf_greedy_tokens(tiny_model_dir, hf_tiny):
    """Three sequences at a time and six requests of different lengths: new prompts are
    prefilled, in chunks, beside decodes, at token counts that pad to a bucket over rows
    an earlier, larger step left in the buffers. (The torch backend: the Triton kernels'
    engine runs are test_triton_backend's; the captured pieces over them, test_gpu_engine's.)"""
    config = EngineConfig(
        model=tiny_model_dir, device="cpu", dtype="float32", num_blocks=96, block_size=8,
        max_num_seqs=3, max_num_batched_tokens=STEP_TOKENS,
    )  # fmt: skip
    engine = LLMEngine(config)
    pieces = RecordingPieces(engine)
    engine.runner.dispatcher = CudagraphDispatcher(piecewise=pieces)
    prompts = sample_prompts(6, 5, 70, hf_tiny.config.vocab_size, seed=5)
    params = staggered_greedy(6, first=3, step=2)
    assert_hf_greedy(hf_tiny, prompts, params, run_to_completion(engine, prompts, params))
    assert pieces.steps, "no step ran piecewise"
    assert any(tokens < size for tokens, size in pieces.steps)  # padding rows ran
    assert any(tokens == STEP_TOKENS for tokens, _ in pieces.steps)  # a full budget's step


def test_beams_through_the_pieces_equal_hf(eos_model_dir, hf_eos):
    """Beam search's steps (forks sharing blocks, beam rows' logits) through the pieces:
    HF's beams and scores."""
    cases = [make_case(seed, hf_eos.config.vocab_size) for seed in range(4)]
    engine = LLMEngine(
        EngineConfig(model=eos_model_dir, device="cpu", dtype="float32", num_blocks=512,
                     block_size=8, max_num_batched_tokens=STEP_TOKENS)
    )  # fmt: skip
    pieces = RecordingPieces(engine)
    engine.runner.dispatcher = CudagraphDispatcher(piecewise=pieces)
    outputs = run_to_completion(engine, [p for p, _ in cases], [p for _, p in cases])
    expected = [hf_beam_search(hf_eos, prompt, params) for prompt, params in cases]
    assert_same(outputs, expected, cases)
    assert pieces.steps


def test_the_pieces_equal_the_model_forward_over_stale_padding(tiny_model_dir):
    """Hidden states of the pieces = the model's forward, row for row, whatever the buffers'
    rows past the step hold (here: NaN)."""
    engine = LLMEngine(
        EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", num_blocks=96)
    )
    runner = engine.runner
    pieces = PiecewiseGraphs(runner.model, runner.kv_cache, STEP_TOKENS, capture=False)
    for buffer in (pieces.qkv, pieces.attended, pieces.residual, pieces.hidden):
        buffer.fill_(float("nan"))
    num_tokens = 21  # one prefill of 21 tokens: bucket 32
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, runner.model.config.vocab_size, (num_tokens,), generator=generator)
    positions = torch.arange(num_tokens)
    table = torch.arange(1, 4, dtype=torch.int32)[None]  # blocks 1-3 of 16 slots
    metadata = runner.backend.prepare(engine_metadata(num_tokens, table, engine.config.block_size))
    with torch.inference_mode():
        expected = runner.model(input_ids, positions, runner.kv_cache.clone(), metadata)
        hidden = pieces.forward(input_ids, positions, metadata)
    assert pieces.bucket(num_tokens) > num_tokens
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)


def engine_metadata(num_tokens: int, table: torch.Tensor, block_size: int) -> AttentionMetadata:
    """One sequence prefilling num_tokens tokens into the blocks of `table`."""
    positions = torch.arange(num_tokens)
    slots = table[0, positions // block_size].long() * block_size + positions % block_size
    return AttentionMetadata(
        slot_mapping=slots,
        block_tables=table,
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32),
        max_seqlen_q=num_tokens,
        max_seqlen_k=num_tokens,
        block_size=block_size,
        seq_lens_host=[num_tokens],
        query_lens_host=[num_tokens],
    )
