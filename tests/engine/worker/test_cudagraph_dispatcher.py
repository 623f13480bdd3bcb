"""The dispatcher's rule (full decode graph, piecewise, eager) and an engine whose steps take
all three, checked on CPU with the graphs not captured (each mode's work run op by op over its
padded buffers): every mode returns hidden states the runner turns into HF's tokens."""

import pytest

from octavo.engine import EngineConfig, LLMEngine, SamplingParams
from octavo.engine.worker.cuda_graphs import DecodeGraphs
from octavo.engine.worker.cudagraph_dispatcher import CudagraphDispatcher, CUDAGraphMode
from octavo.engine.worker.fused_decode import FusedDecode
from octavo.engine.worker.piecewise_graphs import PiecewiseGraphs
from tests.checkpoints import sample_prompts
from tests.engine.helpers import assert_hf_greedy, hf_greedy, run_to_completion

FULL_MAX_SEQS = 2
PIECEWISE_MAX_TOKENS = 16


class RecordingDispatcher(CudagraphDispatcher):
    def __init__(self, full: DecodeGraphs | None, piecewise: PiecewiseGraphs | None):
        super().__init__(full, piecewise)
        self.modes: list[CUDAGraphMode] = []

    def dispatch(
        self, num_tokens: int, uniform_decode: bool, decodes_share_sequences: bool
    ) -> CUDAGraphMode:
        mode = super().dispatch(num_tokens, uniform_decode, decodes_share_sequences)
        self.modes.append(mode)
        return mode


def uncaptured_dispatcher(engine: LLMEngine) -> RecordingDispatcher:
    runner = engine.runner
    full = DecodeGraphs(
        runner.model, runner.kv_cache, FULL_MAX_SEQS, 64, engine.config.block_size, capture=False
    )
    pieces = PiecewiseGraphs(runner.model, runner.kv_cache, PIECEWISE_MAX_TOKENS, capture=False)
    return RecordingDispatcher(full, pieces)


class _Sized:
    def __init__(self, **sizes: int):
        self.__dict__.update(sizes)


@pytest.mark.parametrize(
    ("num_tokens", "uniform_decode", "expected"),
    [
        (1, True, CUDAGraphMode.FULL),
        (FULL_MAX_SEQS, True, CUDAGraphMode.FULL),
        (FULL_MAX_SEQS + 1, True, CUDAGraphMode.PIECEWISE),  # too many sequences for FULL
        (1, False, CUDAGraphMode.PIECEWISE),  # a prefill, or rows that are not sampled
        (PIECEWISE_MAX_TOKENS, False, CUDAGraphMode.PIECEWISE),
        (PIECEWISE_MAX_TOKENS + 1, False, CUDAGraphMode.NONE),
        (PIECEWISE_MAX_TOKENS + 1, True, CUDAGraphMode.NONE),
    ],
)
def test_the_rule(num_tokens, uniform_decode, expected):
    full = _Sized(max_batch_size=FULL_MAX_SEQS, stores_first=False)
    pieces = _Sized(max_num_tokens=PIECEWISE_MAX_TOKENS)
    both = CudagraphDispatcher(full, pieces)  # type: ignore[arg-type]
    assert both.dispatch(num_tokens, uniform_decode, False) is expected
    # Without piecewise graphs what FULL does not take runs eagerly; without any, all does.
    only_full = CudagraphDispatcher(full)  # type: ignore[arg-type]
    assert only_full.dispatch(num_tokens, uniform_decode, False) is (
        expected if expected is CUDAGraphMode.FULL else CUDAGraphMode.NONE
    )
    assert CudagraphDispatcher().dispatch(num_tokens, uniform_decode, False) is CUDAGraphMode.NONE


@pytest.mark.parametrize("stores_first", [False, True])
def test_decodes_of_one_sequence_take_a_full_step_only_where_it_stores_first(stores_first):
    """A draft verified position by position puts rows of one sequence in one decode step:
    a captured decode launch, which stores each row's key as it reads, must not run it."""
    full = _Sized(max_batch_size=FULL_MAX_SEQS, stores_first=stores_first)
    dispatcher = CudagraphDispatcher(full, _Sized(max_num_tokens=PIECEWISE_MAX_TOKENS))  # type: ignore[arg-type]
    want = CUDAGraphMode.FULL if stores_first else CUDAGraphMode.PIECEWISE
    assert dispatcher.dispatch(FULL_MAX_SEQS, True, True) is want
    assert DecodeGraphs.stores_first is False and FusedDecode.stores_first is True


def test_steps_in_every_mode_give_hf_greedy_tokens(tiny_model_dir, hf_tiny):
    """Four requests, three at a time, prompts of 3-30 tokens under a 24-token step budget:
    prefill chunks past PIECEWISE_MAX_TOKENS run eagerly, smaller ones piecewise, decodes of
    three sequences piecewise and of one or two from the full decode graphs, as the batch
    grows and shrinks."""
    engine = LLMEngine(
        EngineConfig(
            model=tiny_model_dir, device="cpu", dtype="float32", num_blocks=64, block_size=8,
            attention_backend="triton", max_num_seqs=3, max_num_batched_tokens=24,
        )
    )  # fmt: skip
    dispatcher = uncaptured_dispatcher(engine)
    engine.runner.dispatcher = dispatcher
    prompts = sample_prompts(4, 3, 30, hf_tiny.config.vocab_size, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5, 12)]
    assert_hf_greedy(hf_tiny, prompts, params, run_to_completion(engine, prompts, params))
    assert set(dispatcher.modes) == set(CUDAGraphMode)
    engine.block_manager.check_invariants()


def test_prompt_logprobs_steps_are_never_full(tiny_model_dir, hf_tiny):
    """A step scoring prompt tokens needs rows a decode graph does not keep: it runs
    piecewise, and its logprobs and tokens are the eager engine's."""
    prompt = sample_prompts(1, 6, 6, hf_tiny.config.vocab_size, seed=2)[0]
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    results = []
    for graphs in (False, True):
        engine = LLMEngine(
            EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", num_blocks=40,
                         block_size=8, attention_backend="triton")
        )  # fmt: skip
        if graphs:
            dispatcher = uncaptured_dispatcher(engine)
            engine.runner.dispatcher = dispatcher
        results.append(run_to_completion(engine, [prompt], params)[0])
    eager, dispatched = results
    assert dispatcher.modes[0] is CUDAGraphMode.PIECEWISE
    assert CUDAGraphMode.FULL in dispatcher.modes[1:]
    assert dispatched.outputs[0].token_ids == hf_greedy(hf_tiny, prompt, 4)
    assert dispatched.outputs[0].token_ids == eager.outputs[0].token_ids
    for got, want in zip(dispatched.prompt_logprobs, eager.prompt_logprobs, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.keys() == want.keys()
            for token in got:
                assert got[token] == pytest.approx(want[token], abs=1e-5)
