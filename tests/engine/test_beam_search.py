"""Beam search against transformers' generate(num_beams=...): same sequences, same order,
same scores, in one continuous batch with sampling requests, with and without preemption;
and the block accounting of copy-on-write forking."""

import random

import pytest
import torch

from octavo.engine import BeamSearchParams, EngineConfig, LLMEngine, SamplingParams
from tests.checkpoints import sample_prompts
from tests.engine.helpers import hf_greedy, run_to_completion

NUM_CASES = 240
WIDTHS = [1, 2, 3, 4, 8]
LENGTH_PENALTIES = [-1.0, 0.0, 0.5, 1.0, 2.0]
EARLY_STOPPING = [True, False, "never"]


def make_case(seed: int, vocab: int) -> tuple[list[int], BeamSearchParams]:
    rng = random.Random(seed)
    width = rng.choice(WIDTHS)
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=rng.randint(1, 40),
        num_return_sequences=rng.randint(1, width),
        length_penalty=rng.choice(LENGTH_PENALTIES),
        early_stopping=rng.choice(EARLY_STOPPING),
    )
    return [rng.randrange(1, vocab) for _ in range(rng.randint(1, 100))], params


def hf_beam_search(hf, prompt: list[int], params: BeamSearchParams, logits_processor=None):
    """HF's returned sequences (generated part, cut after EOS) and their scores. HF runs
    num_beams=1 as greedy search, whose score we compute as ours is defined.
    `logits_processor`: HF's LogitsProcessorList to run after its own processors."""
    eos = hf.config.eos_token_id
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            num_beams=params.beam_width,
            num_return_sequences=params.num_return_sequences,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            max_new_tokens=params.max_tokens,
            min_new_tokens=params.min_tokens,
            do_sample=False,
            output_scores=True,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=eos,
            logits_processor=logits_processor,
        )
    sequences = []
    for row in out.sequences[:, len(prompt) :].tolist():
        sequences.append(row[: row.index(eos) + 1] if eos in row else row)
    if params.beam_width > 1:
        return sequences, out.sequences_scores.tolist()
    steps = [torch.log_softmax(logits[0], -1) for logits in out.logits]
    total = sum(step[t].item() for step, t in zip(steps, sequences[0], strict=False))
    return sequences, [total / len(sequences[0]) ** params.length_penalty]


@pytest.fixture(scope="module")
def cases(hf_eos):
    cases = [make_case(seed, hf_eos.config.vocab_size) for seed in range(NUM_CASES)]
    # A precondition of the parity tests, not a test: the seeds reach every grid value.
    assert {p.beam_width for _, p in cases} == set(WIDTHS)
    assert {p.length_penalty for _, p in cases} == set(LENGTH_PENALTIES)
    assert {str(p.early_stopping) for _, p in cases} == {"True", "False", "never"}
    return cases


@pytest.fixture(scope="module")
def expected(hf_eos, cases):
    expected = [hf_beam_search(hf_eos, prompt, params) for prompt, params in cases]
    stopped = sum(
        bool(seq) and len(seq) < p.max_tokens
        for (_, p), (seqs, _) in zip(cases, expected, strict=True)
        for seq in seqs
    )
    assert stopped > 100, "a precondition: EOS must end many of the oracle's hypotheses early"
    return expected


def assert_same(outputs, expected, cases):
    for i, (output, (sequences, scores)) in enumerate(zip(outputs, expected, strict=True)):
        got = [o.token_ids for o in output.outputs]
        assert got == sequences, f"case {i} {cases[i][1]}"
        for ours, theirs in zip((o.score for o in output.outputs), scores, strict=True):
            # Relative for large scores: with length_penalty -1 a score is the sum of the
            # log-probs times the length, and float32 spacing there exceeds 1e-4 itself.
            assert ours == pytest.approx(theirs, abs=1e-4, rel=1e-6), f"case {i}"


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"num_blocks": 4096, "block_size": 8},
        {"num_blocks": 300, "block_size": 4, "max_num_batched_tokens": 512},
        # Beams need every token first: the engine applies each step before the next.
        {
            "num_blocks": 300,
            "block_size": 4,
            "max_num_batched_tokens": 512,
            "async_scheduling": True,
        },
    ],
    ids=["roomy", "preempting", "preempting_async_scheduling"],
)
def test_beam_search_equals_transformers(eos_model_dir, hf_eos, cases, expected, engine_kwargs):
    engine = LLMEngine(
        EngineConfig(model=eos_model_dir, device="cpu", dtype="float32", **engine_kwargs)
    )
    shares = []  # preempted multi-beam groups that recomputed their prompt once, then forked
    share = engine.scheduler.beam_search.share_prompt
    engine.scheduler.beam_search.share_prompt = lambda g, s: (
        shares.append(len(g.unfinished_seqs)),
        share(g, s),
    )
    # Ordinary greedy requests ride in the same continuous batch.
    greedy_prompts = sample_prompts(6, 5, 60, hf_eos.config.vocab_size, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    outputs = run_to_completion(
        engine,
        [p for p, _ in cases] + greedy_prompts,
        [p for _, p in cases] + [greedy] * len(greedy_prompts),
    )
    assert_same(outputs[:NUM_CASES], expected, cases)
    for prompt, output in zip(greedy_prompts, outputs[NUM_CASES:], strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_eos, prompt, 20)
    if engine_kwargs["num_blocks"] < 1000:
        assert engine.stats().num_preemptions > 0
        assert max(shares) > 1


def test_min_tokens_keeps_eos_out_of_the_first_steps(eos_model_dir, hf_eos):
    """min_tokens masks the stop tokens among each beam's candidates (HF's min_new_tokens);
    the runner hands beam search only the top candidates, so the mask must not starve it."""
    vocab = hf_eos.config.vocab_size
    cases = [
        (prompt, BeamSearchParams(beam_width=width, max_tokens=24, min_tokens=min_tokens))
        for prompt, (width, min_tokens) in zip(
            sample_prompts(6, 3, 40, vocab, seed=9),
            [(1, 6), (2, 10), (3, 24), (4, 5), (8, 12), (4, 1)],
            strict=True,
        )
    ]
    expected = [hf_beam_search(hf_eos, prompt, params) for prompt, params in cases]
    engine = LLMEngine(
        EngineConfig(model=eos_model_dir, device="cpu", dtype="float32", num_blocks=2048)
    )
    outputs = run_to_completion(engine, [p for p, _ in cases], [p for _, p in cases])
    assert_same(outputs, expected, cases)
    for output, (_, params) in zip(outputs, cases, strict=True):
        assert all(len(o.token_ids) >= params.min_tokens for o in output.outputs)


def test_block_accounting_of_forking_beams(eos_model_dir, hf_eos):
    """Beams share the prompt once and copy at most beam_width blocks per step."""
    width, block_size = 8, 4
    engine = LLMEngine(
        EngineConfig(
            model=eos_model_dir,
            device="cpu",
            dtype="float32",
            num_blocks=512,
            block_size=block_size,
        )
    )
    bm = engine.block_manager
    copies_per_step: list[int] = []
    engine.core.step_observers.append(
        lambda output: copies_per_step.append(len(output.blocks_to_copy))
    )
    prompt = sample_prompts(1, 37, 37, hf_eos.config.vocab_size, seed=2)[0]
    params = BeamSearchParams(beam_width=width, max_tokens=30, ignore_eos=True)
    engine.add_request("beams", prompt, params)
    prompt_blocks = bm.num_blocks_for_tokens(len(prompt))
    while engine.has_unfinished_requests():
        outputs = engine.step()
        bm.check_invariants()
        if not engine.scheduler.running:
            continue
        group = engine.scheduler.running[0]
        held = {b for s in group.unfinished_seqs for b in bm.get_block_table(s)}
        generated = group.unfinished_seqs[0].num_output_tokens
        limit = prompt_blocks + width * (bm.num_blocks_for_tokens(generated) + 1)
        assert len(held) <= limit
        assert len(group.unfinished_seqs) <= width
    assert max(copies_per_step) <= width and sum(copies_per_step) > 0
    assert bm.num_free_blocks == bm.num_usable_blocks
    best = outputs[0].outputs[0]
    assert len(best.token_ids) == 30 and best.finish_reason == "length"


def test_beam_requests_that_could_never_run_are_refused(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig(
            model=tiny_model_dir,
            device="cpu",
            dtype="float32",
            num_blocks=64,
            block_size=8,
            max_num_seqs=4,
        )
    )
    with pytest.raises(ValueError, match="beam_width"):
        engine.add_request("wide", [1, 2], BeamSearchParams(beam_width=8, max_tokens=4))
    with pytest.raises(ValueError, match="beam_width"):  # 4 x 256 tokens > 63 blocks of 8
        engine.add_request("long", [1] * 200, BeamSearchParams(beam_width=4, max_tokens=56))


def test_beam_params_are_validated():
    for kwargs, name in [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 2, "num_return_sequences": 3}, "num_return_sequences"),
        ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ]:
        with pytest.raises(ValueError, match=name):
            BeamSearchParams(**kwargs)


def test_an_aborted_beam_search_reports_its_live_beams(eos_model_dir):
    engine = LLMEngine(
        EngineConfig(
            model=eos_model_dir, device="cpu", dtype="float32", num_blocks=256, block_size=4
        )
    )
    params = BeamSearchParams(beam_width=3, max_tokens=30, num_return_sequences=2, ignore_eos=True)
    engine.add_request("r", [5, 6, 7], params)
    for _ in range(4):
        engine.step()
    final = engine.abort_request("r")
    assert final.finished and [o.finish_reason for o in final.outputs] == ["abort", "abort"]
    assert all(len(o.token_ids) == 4 for o in final.outputs)
    assert final.outputs[0].score >= final.outputs[1].score
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks
