"""Scheduling policies (request_queue.py) through the scheduler with a fake model: whom each
admits next, whom it preempts, the fair policy's counters and their bound."""

import itertools

import pytest

from octavo.engine.core import request_queue
from octavo.engine.core.block_manager import BlockManager
from octavo.engine.core.request_queue import FairRequestQueue, create_request_queue
from octavo.engine.core.scheduler import Scheduler, SchedulerConfig
from octavo.engine.core.sequence import Sequence, SequenceGroup
from octavo.engine.core.stop_checker import StopChecker
from octavo.engine.sampling_params import SamplingParams
from octavo.engine.step_io import ModelRunnerOutput, SamplerOutput
from octavo.engine.stop_rules import length_limit

EOS = 0
_tokens = itertools.count(10)
_arrivals = itertools.count()


def make_scheduler(policy, num_blocks=64, block_size=4, budget=64, max_num_seqs=4):
    bm = BlockManager(num_blocks, block_size, False)
    config = SchedulerConfig(max_num_seqs, budget, scheduling_policy=policy)
    return Scheduler(config, bm, StopChecker([EOS])), bm


def add(scheduler, request_id, prompt_len=4, max_tokens=8, priority=0, user=""):
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    group = SequenceGroup(
        request_id,
        list(range(1, prompt_len + 1)),
        sampling,
        arrival_time=float(next(_arrivals)),
        stop_token_ids=frozenset(),
        max_num_tokens=length_limit(prompt_len, max_tokens, 256),
        priority=priority,
        user=user,
    )
    group.seqs.append(Sequence(scheduler.new_seq_id(), group.prompt_token_ids))
    scheduler.add(group)
    return group


def step(scheduler, bm):
    """One step with a fake model sampling a fresh non-EOS token per row; the step."""
    out = scheduler.schedule()
    seq_ids = [seq_id for s in out.output.scheduled for seq_id in s.sample_seq_ids]
    tokens = [next(_tokens) for _ in seq_ids]
    sampled = SamplerOutput(tokens, [0.0] * len(seq_ids), [None] * len(seq_ids))
    scheduler.update(out, ModelRunnerOutput(seq_ids, sampled))
    bm.check_invariants()
    return out


def running_ids(scheduler):
    return sorted(g.request_id for g in scheduler.running)


def drain(scheduler, bm, limit=500):
    for _ in range(limit):
        if not scheduler.has_unfinished():
            break
        step(scheduler, bm)
    assert not scheduler.has_unfinished()
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="scheduling_policy"):
        create_request_queue("lifo")


def test_fcfs_admits_by_arrival_and_never_preempts_to_admit():
    scheduler, bm = make_scheduler("fcfs", max_num_seqs=2)
    add(scheduler, "a")
    add(scheduler, "b")
    step(scheduler, bm)
    add(scheduler, "c", priority=-5)  # fcfs reads no priority
    out = step(scheduler, bm)
    assert running_ids(scheduler) == ["a", "b"] and out.preempted == []
    assert [g.request_id for g in scheduler.waiting] == ["c"]
    drain(scheduler, bm)


def test_priority_admits_the_most_urgent_first_ties_by_arrival():
    scheduler, bm = make_scheduler("priority", max_num_seqs=1)
    for request_id, priority in [("late", 3), ("urgent", 1), ("mid", 2), ("urgent2", 1)]:
        add(scheduler, request_id, max_tokens=2, priority=priority)
    order = []
    while scheduler.has_unfinished():
        step(scheduler, bm)
        for group in scheduler.running:
            if group.request_id not in order:
                order.append(group.request_id)
    assert order == ["urgent", "urgent2", "mid", "late"]
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_priority_preempts_the_least_urgent_running_request_to_admit():
    scheduler, bm = make_scheduler("priority", max_num_seqs=2)
    add(scheduler, "a", priority=5)
    add(scheduler, "b", priority=7)
    step(scheduler, bm)
    add(scheduler, "c", priority=6)  # more urgent than b only
    out = step(scheduler, bm)
    assert [g.request_id for g in out.preempted] == ["b"]
    assert running_ids(scheduler) == ["a", "c"]
    add(scheduler, "d", priority=9)  # less urgent than everything running: waits
    out = step(scheduler, bm)
    assert out.preempted == [] and running_ids(scheduler) == ["a", "c"]
    drain(scheduler, bm)


def test_priority_preempts_the_least_urgent_for_blocks():
    # 8 usable blocks of 4 tokens: three requests of 8 + 8 tokens cannot all grow.
    scheduler, bm = make_scheduler("priority", num_blocks=9, max_num_seqs=3)
    add(scheduler, "low", prompt_len=8, priority=9)
    add(scheduler, "high", prompt_len=8, priority=0)
    add(scheduler, "mid", prompt_len=8, priority=5)
    preempted = []
    while scheduler.has_unfinished():
        preempted += [g.request_id for g in step(scheduler, bm).preempted]
    assert preempted and set(preempted) <= {"low", "mid"}
    assert preempted[0] == "low"
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_fair_gives_a_newcomer_a_seat_of_the_user_above_its_share():
    scheduler, bm = make_scheduler("fair", max_num_seqs=4)
    for i in range(6):
        add(scheduler, f"flood{i}", max_tokens=30, user="flood")
    for _ in range(3):
        step(scheduler, bm)
    assert len(scheduler.running) == 4
    add(scheduler, "chat", max_tokens=3, user="chat")
    # Lifted to the flood's counter, the newcomer ties it and goes first among equals (one
    # request waiting against the flood's two): the next step takes a seat of the flood.
    out = step(scheduler, bm)
    assert [g.user for g in out.preempted] == ["flood"]
    assert "chat" in running_ids(scheduler)
    queue = scheduler.waiting
    assert isinstance(queue, FairRequestQueue)
    # The newcomer was lifted to the flood's counter: its absence earned it nothing.
    assert queue.counters["chat"] >= queue.counters["flood"] - 2 * 30 * 4
    drain(scheduler, bm)


def test_fair_does_not_preempt_users_at_their_share():
    scheduler, bm = make_scheduler("fair", max_num_seqs=4)
    for i in range(4):
        add(scheduler, f"a{i}", max_tokens=20, user="a" if i < 2 else "b")
    step(scheduler, bm)
    add(scheduler, "a4", user="a")
    add(scheduler, "b4", user="b")
    preempted = [g for _ in range(10) for g in step(scheduler, bm).preempted]
    assert preempted == []
    drain(scheduler, bm)


def test_fair_shares_tokens_between_backlogged_users():
    """User long sends prompts four times as long; both stay backlogged. Each user's counted
    service (prompt tokens x1, output tokens x2) ends within 10% of the other's."""
    scheduler, bm = make_scheduler("fair", num_blocks=512, budget=256, max_num_seqs=4)
    for i in range(40):
        add(scheduler, f"long{i}", prompt_len=64, max_tokens=16, user="long")
        add(scheduler, f"short{i}", prompt_len=16, max_tokens=16, user="short")
    queue = scheduler.waiting
    assert isinstance(queue, FairRequestQueue)
    for _ in range(150):  # both still backlogged at the end
        step(scheduler, bm)
    assert {g.user for g in scheduler.waiting} == {"long", "short"}
    long, short = queue.counters["long"], queue.counters["short"]
    assert abs(long - short) <= 0.1 * max(long, short)
    drain(scheduler, bm, limit=2000)


def test_fair_forgets_idle_users_beyond_its_bound(monkeypatch):
    monkeypatch.setattr(request_queue, "MAX_IDLE_USERS", 8)
    scheduler, bm = make_scheduler("fair", max_num_seqs=4)
    queue = scheduler.waiting
    assert isinstance(queue, FairRequestQueue)
    for i in range(100):
        add(scheduler, f"r{i}", max_tokens=1, user=f"user{i}")
        step(scheduler, bm)
        assert len(queue.counters) <= 8 + 1 + len(scheduler.running) + len(queue)
    drain(scheduler, bm)
    assert len(queue.counters) <= 8 + 1
