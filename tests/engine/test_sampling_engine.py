"""Sampling through the whole engine: seeds, n > 1 forking, logprobs vs HF, stops, limits."""

import pytest
import torch

from octavo.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.checkpoints import sample_prompts
from tests.engine.helpers import run_to_completion

SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True
)


@pytest.fixture(params=[False, True], ids=["sync", "async_scheduling"])
def async_scheduling(request) -> bool:
    """Every engine test here also runs one step ahead: tokens reach the host a step late."""
    return request.param


def make_engine(model_dir, **overrides) -> LLMEngine:
    config = {
        "model": model_dir,
        "device": "cpu",
        "dtype": "float32",
        "num_blocks": 256,
        "block_size": 8,
    } | overrides
    return LLMEngine(EngineConfig(**config))


@pytest.fixture(scope="module")
def prompts(hf_tiny):
    return sample_prompts(8, 3, 90, hf_tiny.config.vocab_size, seed=1)


def test_seeded_sampling_is_independent_of_the_batch(tiny_model_dir, prompts, async_scheduling):
    target = prompts[0]
    others = SamplingParams(temperature=1.0, max_tokens=12)
    alone = run_to_completion(
        make_engine(tiny_model_dir, async_scheduling=async_scheduling),
        [target],
        SEEDED,
    )[0]
    crowd = run_to_completion(
        make_engine(tiny_model_dir, async_scheduling=async_scheduling, seed=5),
        prompts[1:4] + [target] + prompts[4:],
        [others] * 3 + [SEEDED] + [others] * 4,
    )[3]
    chunked = run_to_completion(
        make_engine(
            tiny_model_dir, async_scheduling=async_scheduling, max_num_batched_tokens=7, seed=9
        ),
        prompts[::-1],
        [others] * 7 + [SEEDED],
    )[7]
    tokens = alone.outputs[0].token_ids
    assert len(tokens) == 20
    assert crowd.outputs[0].token_ids == tokens
    assert chunked.outputs[0].token_ids == tokens
    unseeded = run_to_completion(
        make_engine(tiny_model_dir, async_scheduling=async_scheduling),
        [target],
        SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True),
    )
    assert unseeded[0].outputs[0].token_ids != tokens


def test_preemption_changes_no_seeded_token(tiny_model_dir, prompts, async_scheduling):
    """A preempted sequence keeps its worker state (its generator, the outputs a penalty reads,
    the rows min_tokens counts): recomputed, it draws exactly what it would have drawn."""
    target = SamplingParams(
        n=2, temperature=1.0, seed=77, max_tokens=40, min_tokens=30, presence_penalty=0.5
    )
    alone = run_to_completion(
        make_engine(tiny_model_dir, async_scheduling=async_scheduling), [prompts[0]], target
    )[0]
    # 40 blocks of 8 tokens for 8 requests of up to 130 tokens: the target, admitted last,
    # is the first one preempted.
    engine = make_engine(
        tiny_model_dir, async_scheduling=async_scheduling, num_blocks=40,
        max_num_batched_tokens=96, seed=3,
    )  # fmt: skip
    others = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(f"other-{i}", prompt, others)
    engine.add_request("target", prompts[0], target)
    was_running = preempted = False
    crowded = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == "target" and output.finished:
                crowded = output
        waiting = {g.request_id for g in engine.scheduler.waiting}
        preempted |= was_running and "target" in waiting
        was_running = any(g.request_id == "target" for g in engine.scheduler.running)
    assert preempted and crowded is not None
    assert [c.token_ids for c in crowded.outputs] == [c.token_ids for c in alone.outputs]
    assert all(len(c.token_ids) >= 30 for c in alone.outputs)


def test_parallel_samples_share_the_prompt_blocks(tiny_model_dir, prompts, async_scheduling):
    engine = make_engine(tiny_model_dir, async_scheduling=async_scheduling)
    prompt = prompts[2]  # several full blocks plus a partial one
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    engine.add_request("r", prompt, params)
    engine.step()
    bm = engine.block_manager
    seqs = engine.scheduler.running[0].seqs
    tables = [bm.get_block_table(s) for s in seqs]
    assert len(seqs) == 3 and tables[0] == tables[1] == tables[2]
    assert bm.num_usable_blocks - bm.num_free_blocks == bm.num_blocks_for_tokens(len(prompt))
    assert all(bm.ref_counts[b] == 3 for b in tables[0])
    engine.step()  # each sample writes its first token: the partial block is copied twice
    full = len(prompt) // bm.block_size
    assert all(bm.get_block_table(s)[:full] == tables[0][:full] for s in seqs)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        bm.check_invariants()
    samples = [o.token_ids for o in outputs[0].outputs]
    assert len(samples) == 3 and len({tuple(s) for s in samples}) == 3
    assert bm.num_free_blocks == bm.num_usable_blocks
    again = run_to_completion(
        make_engine(tiny_model_dir, async_scheduling=async_scheduling),
        [prompt],
        params,
    )[0]
    assert [o.token_ids for o in again.outputs] == samples


def test_logprobs_equal_hf_log_softmax(tiny_model_dir, hf_tiny, prompts, async_scheduling):
    prompt = prompts[3]
    out = run_to_completion(
        make_engine(tiny_model_dir, async_scheduling=async_scheduling),
        [prompt],
        SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
    )[0].outputs[0]
    with torch.no_grad():
        hf = hf_tiny.generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    steps = [torch.log_softmax(logits[0], -1) for logits in hf.logits]
    assert out.token_ids == hf.sequences[0, len(prompt) :].tolist()
    expected = sum(step[t].item() for step, t in zip(steps, out.token_ids, strict=True))
    assert out.cumulative_logprob == pytest.approx(expected, abs=1e-4)
    for step, token, entry in zip(steps, out.token_ids, out.logprobs, strict=True):
        top = step.topk(3)
        assert set(entry) == {token, *top.indices.tolist()}
        for t, value in entry.items():
            assert value == pytest.approx(step[t].item(), abs=1e-4)


def test_text_prompts_and_stop_strings_end_to_end(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, device="cpu", dtype="float32", num_blocks=128, block_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate("The return statement", greedy, use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.text) > 20
    stop = full.text[12:16]
    assert stop.strip()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    cut = llm.generate("The return statement", params, use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


def test_max_tokens_and_max_model_len_end_with_length(tiny_model_dir, async_scheduling):
    engine = make_engine(tiny_model_dir, async_scheduling=async_scheduling, max_model_len=30)
    outputs = run_to_completion(
        engine,
        [[5] * 25, [6] * 30, [7] * 3],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 1, 10]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_eos_stops_and_min_tokens_holds_it_back(eos_model_dir, hf_eos, async_scheduling):
    eos = hf_eos.config.eos_token_id
    prompts = sample_prompts(12, 2, 40, hf_eos.config.vocab_size, seed=3)
    outputs = run_to_completion(
        make_engine(eos_model_dir, async_scheduling=async_scheduling),
        prompts,
        SamplingParams(temperature=0, max_tokens=30),
    )
    stopped = [
        (p, o.outputs[0])
        for p, o in zip(prompts, outputs, strict=True)
        if o.outputs[0].finish_reason == "stop"
    ]
    assert len(stopped) >= 3
    prompt, out = stopped[0]
    assert out.token_ids[-1] == eos and eos not in out.token_ids[:-1] and out.stop_reason is None
    forced = SamplingParams(temperature=0, max_tokens=30, min_tokens=len(out.token_ids) + 2)
    longer = run_to_completion(
        make_engine(eos_model_dir, async_scheduling=async_scheduling),
        [prompt],
        forced,
    )[0].outputs[0]
    assert longer.token_ids[: len(out.token_ids) - 1] == out.token_ids[:-1]
    assert eos not in longer.token_ids[: len(out.token_ids) + 2]
    ignoring = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = run_to_completion(
        make_engine(eos_model_dir, async_scheduling=async_scheduling),
        [prompt],
        ignoring,
    )[0].outputs[0]
    assert len(full.token_ids) == 30 and full.token_ids[: len(out.token_ids)] == out.token_ids
