"""The engine keeps nothing of the requests it has finished.

After a warm-up round of each kind of request (sampled, n > 1, best_of, seeded, penalized,
logprobs, constrained, beam search, stop strings, aborted, failed; a small KV cache
preempts many of them), more rounds of the same kind leave the same live engine objects
(exactly), the same Python heap (tracemalloc, within what interpreter free lists keep) and
the same resident memory (within the allocator's noise). And the KV cache is resident from
the start: filling every block with new content, which the prefix cache keeps, does not
grow the process.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import tracemalloc
from collections import Counter
from collections.abc import Callable

import pytest

from octavo.engine import (
    BeamSearchParams,
    EngineConfig,
    LLMEngine,
    SamplingParams,
    StructuredOutputsParams,
)
from octavo.engine.frontend import output_processor
from tests.checkpoints import TinySpec, make_checkpoint, sample_prompts

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads resident memory from /proc"
)

ROUND = 50  # requests of a round
MEASURED_ROUNDS = 2
# The Python heap a kind may add over its measured rounds: what the interpreter's free lists
# and containers' spare capacity keep; a request that left its tokens, a state object or a
# sampling slot behind adds more (MEASURED_ROUNDS * ROUND of them).
HEAP_SLACK = 32 * 1024
# Resident memory a kind may add: the C allocator's noise.
RSS_SLACK = 4 * 1024 * 1024
FAILING = "fails"  # a kind whose requests fail in the output processor

Params = SamplingParams | BeamSearchParams


def _params(**kwargs) -> Callable[[int], Params]:
    return lambda i: SamplingParams(max_tokens=6, **kwargs)


JSON_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
KINDS: dict[str, Callable[[int], Params]] = {
    "greedy": _params(temperature=0),
    "sampled": _params(temperature=1.0, ignore_eos=True),
    "n3": _params(temperature=1.0, n=3, ignore_eos=True),
    "best_of": _params(temperature=1.0, best_of=3),
    "seeded": lambda i: SamplingParams(max_tokens=6, temperature=1.0, seed=i, n=2),
    "penalized": _params(
        temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5
    ),
    "logprobs": _params(temperature=1.0, logprobs=2, prompt_logprobs=1),
    "processed": _params(temperature=1.0, logit_bias={5: 2.0}, bad_words=["the"], min_tokens=2),
    "stop": _params(temperature=1.0, stop=["e", "a"]),
    "json": _params(temperature=1.0, structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA)),
    "choice": _params(
        temperature=1.0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    ),
    "beam": lambda i: BeamSearchParams(beam_width=2, max_tokens=6),
    "aborted": _params(temperature=1.0, ignore_eos=True),
    FAILING: _params(temperature=1.0, ignore_eos=True),
}


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def engine_objects() -> Counter[str]:
    """Live objects of the engine's own classes, by class."""
    names = ((type(o).__module__, type(o).__qualname__) for o in gc.get_objects())
    return Counter(name for module, name in names if str(module).startswith("octavo."))


def run_round(engine: LLMEngine, kind: str, seed: int) -> None:
    """ROUND requests of `kind` with distinct prompts, to the end; every block free after."""
    prompts = sample_prompts(ROUND, 8, 24, engine.model_config.vocab_size, seed=seed)
    ids = [f"{kind}-{seed}-{i}" for i in range(ROUND)]
    for i, (request_id, prompt) in enumerate(zip(ids, prompts, strict=True)):
        engine.add_request(request_id, prompt, KINDS[kind](seed + i))
    failed = 0
    steps = 0
    while engine.has_unfinished_requests():
        failed += sum(output.error is not None for output in engine.step())
        steps += 1
        if kind == "aborted" and steps == 3:
            for request_id in ids:
                engine.abort_request(request_id)
    assert failed == (ROUND if kind == FAILING else 0)
    # The worker drops a sequence's state when the next step lists it finished: one more
    # request leaves only its own state there, whatever the round left.
    engine.add_request(f"flush-{seed}", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    block_manager = engine.block_manager
    block_manager.check_invariants()
    assert block_manager.num_free_blocks == block_manager.num_usable_blocks


def fail_in_output_processor(engine: LLMEngine) -> None:
    """Makes building the outputs of every FAILING request raise (its request fails alone)."""
    processor = engine.output_processor
    apply = processor._apply

    def poisoned(state, sample, delta):
        if state.request_id.startswith(FAILING):
            raise RuntimeError("injected output fault")
        apply(state, sample, delta)

    processor._apply = poisoned


def test_finished_requests_leave_nothing_behind(tiny_model_dir, monkeypatch):
    # pytest's log capture keeps every record, and the record of a failed request keeps its
    # traceback, whose frames hold the request: the failures are not logged here.
    monkeypatch.setattr(logging.getLogger(output_processor.__name__), "disabled", True)
    # 128 blocks of 4 tokens: a round's requests do not fit at once, so many are preempted.
    # float32: in bfloat16 a row bucket's first product compiles a kernel that stays cached (a
    # bounded first use, tests/engine/worker/models/test_linear.py), which a round may meet first.
    engine = LLMEngine(
        EngineConfig(
            model=tiny_model_dir,
            device="cpu",
            dtype="float32",
            num_blocks=128,
            block_size=4,
            max_num_seqs=32,
        )
    )
    fail_in_output_processor(engine)
    tracemalloc.start()
    try:
        for number, kind in enumerate(KINDS):  # warm-up: first-use caches, buffers, free lists
            run_round(engine, kind, seed=number)
        gc.collect()
        objects = engine_objects()
        # What is alive now (the suite's earlier tests, this engine) leaves the collector's
        # reach: each kind's collection walks only what the rounds add.
        gc.freeze()
        growth = {}
        for number, kind in enumerate(KINDS):
            heap, rss = tracemalloc.get_traced_memory()[0], resident_bytes()
            for k in range(1, MEASURED_ROUNDS + 1):
                run_round(engine, kind, seed=1000 * k + number)
            gc.collect()
            growth[kind] = (tracemalloc.get_traced_memory()[0] - heap, resident_bytes() - rss)
    finally:
        tracemalloc.stop()
        gc.unfreeze()
    gc.collect()
    left = engine_objects()
    assert engine.stats().num_preemptions > 0
    left.subtract(objects)
    assert not +left, f"engine objects left: {+left}"
    leaks = {k: g for k, g in growth.items() if g[0] > HEAP_SLACK or g[1] > RSS_SLACK}
    assert not leaks, f"(heap bytes, resident bytes) added by kind: {leaks}"


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> str:
    """The tiny model 256 wide: 4 KB of K/V a token, so a cache of a few thousand blocks is
    far larger than the allocator's noise."""
    return make_checkpoint(tmp_path_factory.mktemp("wide"), TinySpec(n_embd=256))


def test_filling_the_kv_cache_does_not_grow_the_process(wide_model_dir):
    """Prompts of new content fill every block once; the prefix cache keeps each filled
    block until it is evicted. A cache whose pages were committed only when first written
    (torch.empty) grew the process by the whole cache here."""
    block_size, num_blocks, prompt_len = 16, 4096, 64
    engine = LLMEngine(
        EngineConfig(
            model=wide_model_dir, device="cpu", num_blocks=num_blocks, block_size=block_size
        )
    )
    cache = engine.runner.kv_cache
    cache_bytes = cache.numel() * cache.element_size()
    params = SamplingParams(max_tokens=1, temperature=0)
    vocab = engine.model_config.vocab_size
    num_requests = num_blocks * block_size // prompt_len + 32  # every block, then evictions

    def fill(count: int, seed: int) -> None:
        prompts = sample_prompts(count, prompt_len, prompt_len, vocab, seed=seed)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"fill-{seed}-{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()

    fill(32, seed=1)  # warm-up
    gc.collect()
    before = resident_bytes()
    fill(num_requests, seed=2)
    gc.collect()
    block_manager = engine.block_manager
    assert block_manager.num_cached_blocks == block_manager.num_usable_blocks
    assert resident_bytes() - before < cache_bytes // 8, (before, resident_bytes(), cache_bytes)
