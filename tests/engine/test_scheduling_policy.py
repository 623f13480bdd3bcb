"""Scheduling policies through the whole engine: the urgent or the underserved request gets its
first token within a step or two of arriving behind a full engine, the greedy outputs of the
requests it preempts are those of a run without preemption, and every block is free after."""

import pytest

from octavo.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from octavo.engine.errors import ParameterError
from tests.checkpoints import sample_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def make_engine(model_dir, **overrides) -> LLMEngine:
    config = {
        "model": model_dir,
        "device": "cpu",
        "dtype": "float32",
        "num_blocks": 256,
        "block_size": 8,
        "max_num_seqs": 4,
    } | overrides
    return LLMEngine(EngineConfig(**config))


@pytest.fixture(scope="module")
def prompts(hf_tiny):
    return sample_prompts(7, 6, 20, hf_tiny.config.vocab_size, seed=3)


def run_with_late_arrival(engine, prompts, late_kwargs, early_kwargs):
    """The first six prompts fill the engine; after three steps the seventh arrives.
    Returns each request's tokens, the steps the late one waited for its first token, and
    the number of preemptions."""
    for i, prompt in enumerate(prompts[:-1]):
        engine.add_request(f"early{i}", prompt, GREEDY, **early_kwargs(i))
    for _ in range(3):
        engine.step()
    engine.add_request("late", prompts[-1], GREEDY, **late_kwargs)
    tokens: dict[str, list[int]] = {}
    steps_to_first = None
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        engine.block_manager.check_invariants()
        for output in outputs:
            late = output.request_id == "late" and steps_to_first is None
            if late and output.outputs and output.outputs[0].token_ids:
                steps_to_first = steps
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    return tokens, steps_to_first, engine.scheduler.num_preemptions


def greedy_alone(model_dir, prompts):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_blocks=256, block_size=8)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_priority_serves_the_urgent_request_next_and_changes_no_greedy_output(
    tiny_model_dir, prompts
):
    engine = make_engine(tiny_model_dir, scheduling_policy="priority")
    tokens, steps_to_first, preemptions = run_with_late_arrival(
        engine, prompts, {"priority": -1}, lambda i: {"priority": i % 3}
    )
    assert steps_to_first is not None and steps_to_first <= 2
    assert preemptions >= 1
    expected = greedy_alone(tiny_model_dir, prompts)
    names = [f"early{i}" for i in range(6)] + ["late"]
    assert [tokens[name] for name in names] == expected


def test_fcfs_makes_the_late_request_wait_for_a_seat(tiny_model_dir, prompts):
    """The contrast the policies are for: under fcfs the late request waits for a request
    to finish (24 tokens)."""
    engine = make_engine(tiny_model_dir)
    _, steps_to_first, preemptions = run_with_late_arrival(engine, prompts, {}, lambda i: {})
    assert steps_to_first is not None and steps_to_first > 10 and preemptions == 0


def test_fair_serves_a_newcomer_beside_a_flood_and_changes_no_greedy_output(
    tiny_model_dir, prompts
):
    engine = make_engine(tiny_model_dir, scheduling_policy="fair")
    tokens, steps_to_first, preemptions = run_with_late_arrival(
        engine, prompts, {"user": "chat"}, lambda i: {"user": "batch"}
    )
    assert steps_to_first is not None and steps_to_first <= 3
    assert preemptions >= 1
    expected = greedy_alone(tiny_model_dir, prompts)
    names = [f"early{i}" for i in range(6)] + ["late"]
    assert [tokens[name] for name in names] == expected


def test_llm_generate_takes_a_priority_per_prompt(tiny_model_dir, prompts):
    llm = LLM(
        model=tiny_model_dir, device="cpu", dtype="float32", num_blocks=256, block_size=8,
        scheduling_policy="priority", max_num_seqs=2,
    )  # fmt: skip
    outputs = llm.generate(prompts[:3], GREEDY, use_tqdm=False, priority=[2, 0, 1])
    assert [o.outputs[0].token_ids for o in outputs] == greedy_alone(tiny_model_dir, prompts[:3])
    first_token = [o.metrics.first_token_time for o in outputs]
    assert first_token[1] <= first_token[2] <= first_token[0]
    with pytest.raises(ValueError, match="priority has 1 entries for 3 prompts"):
        llm.generate(prompts[:3], GREEDY, use_tqdm=False, priority=[0])


@pytest.mark.parametrize(
    ("policy", "priority", "match"),
    [
        ("fcfs", 1, "needs --scheduling-policy priority"),
        ("fair", -3, "needs --scheduling-policy priority"),
        ("priority", True, "must be an integer"),
        ("priority", 1.5, "must be an integer"),
        ("priority", 2**63, "must fit in 64 bits"),
    ],
)
def test_a_bad_priority_is_refused_by_name_and_queues_nothing(
    tiny_model_dir, prompts, policy, priority, match
):
    engine = make_engine(tiny_model_dir, scheduling_policy=policy)
    with pytest.raises(ParameterError, match=match) as caught:
        engine.add_request("r", prompts[0], GREEDY, priority=priority)
    assert caught.value.param == "priority"
    assert not engine.has_unfinished_requests()
    engine.add_request("r", prompts[0], GREEDY, priority=0)  # the id was not taken
    assert engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"fair_output_token_weight": 0.0}, "fair_output_token_weight"),
        ({"fair_prompt_token_weight": -1.0}, "fair_prompt_token_weight"),
    ],
)
def test_a_bad_policy_setting_is_refused_by_name(tiny_model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=tiny_model_dir, **kwargs)
