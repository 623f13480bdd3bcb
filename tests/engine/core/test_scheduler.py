"""Scheduler: token budget, chunked prefill, decode-first, preemption, abort, n > 1 forking."""

import itertools

from octavo.engine.core.block_manager import BlockManager
from octavo.engine.core.scheduled_step import ScheduledStep
from octavo.engine.core.scheduler import Scheduler, SchedulerConfig
from octavo.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from octavo.engine.core.stop_checker import StopChecker
from octavo.engine.sampling_params import SamplingParams
from octavo.engine.step_io import ModelRunnerOutput, SamplerOutput
from octavo.engine.stop_rules import length_limit, stop_token_set

EOS = 0
_tokens = itertools.count(10)


MAX_MODEL_LEN = 64


def make_scheduler(
    num_blocks=16, block_size=4, budget=64, max_num_seqs=8, prefill_interval=1,
    prefix_caching=False,
):  # fmt: skip
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    config = SchedulerConfig(max_num_seqs, budget, prefill_interval)
    scheduler = Scheduler(config, bm, StopChecker([EOS]))
    return scheduler, bm


def add(scheduler, request_id, prompt_len, **params):
    params.setdefault("max_tokens", 8)
    sampling = SamplingParams(temperature=0.0, **params)
    group = SequenceGroup(
        request_id,
        list(range(1, prompt_len + 1)),
        sampling,
        arrival_time=0.0,
        stop_token_ids=frozenset(
            stop_token_set(sampling.stop_token_ids, sampling.ignore_eos, [EOS])
        ),
        max_num_tokens=length_limit(prompt_len, sampling.max_tokens, MAX_MODEL_LEN),
    )
    group.seqs.append(Sequence(scheduler.new_seq_id(), group.prompt_token_ids))
    scheduler.add(group)
    return group


def step(scheduler: Scheduler, bm: BlockManager) -> ScheduledStep:
    """One engine step with a fake model that samples a fresh non-EOS token per row."""
    out = scheduler.schedule()
    bm.check_invariants()
    seq_ids = [seq_id for s in out.output.scheduled for seq_id in s.sample_seq_ids]
    rows = len(seq_ids)
    tokens = [next(_tokens) for _ in range(rows)]
    sampled = SamplerOutput(tokens, [0.0] * rows, [None] * rows)
    scheduler.update(out, ModelRunnerOutput(seq_ids, sampled))
    bm.check_invariants()
    return out


def plan(out: ScheduledStep) -> list[tuple[str, int]]:
    return [
        (group.request_id, s.num_new_tokens)
        for s, (group, _, _) in zip(out.output.scheduled, out.entries, strict=True)
    ]


def sampled_seqs(out: ScheduledStep, index: int) -> list[Sequence]:
    """The sequences sampled from scheduled sequence `index`, checked against the ids the
    worker gets."""
    item, (_, _, seqs) = out.output.scheduled[index], out.entries[index]
    assert list(item.sample_seq_ids) == [s.seq_id for s in seqs]
    return list(seqs)


def test_long_prompt_is_prefilled_in_chunks_under_the_token_budget():
    scheduler, bm = make_scheduler(budget=8)
    group = add(scheduler, "a", 20)
    seq = group.seqs[0]
    out = step(scheduler, bm)
    assert plan(out) == [("a", 8)] and sampled_seqs(out, 0) == []
    assert bm.get_block_table(seq) == [1, 2]
    out = step(scheduler, bm)
    assert plan(out) == [("a", 8)]
    assert bm.get_block_table(seq) == [1, 2, 3, 4]
    out = step(scheduler, bm)
    assert plan(out) == [("a", 4)] and sampled_seqs(out, 0) == [seq]
    assert seq.num_output_tokens == 1 and seq.num_computed_tokens == 20
    out = step(scheduler, bm)
    assert plan(out) == [("a", 1)]
    assert bm.get_block_table(seq) == [1, 2, 3, 4, 5, 6]  # position 20 opens a sixth block


def test_a_decode_that_opens_a_block_takes_it_tells_the_worker_and_caches_the_full_one():
    """A running sequence whose next token starts a new block gets it in that step, the
    step's tables carry the new table to the worker, and with prefix caching the block the
    previous tokens filled is registered then: a prompt of those tokens finds it."""
    scheduler, bm = make_scheduler(num_blocks=8, block_size=4, prefix_caching=True)
    group = add(scheduler, "a", 3, max_tokens=6)
    seq = group.seqs[0]
    step(scheduler, bm)  # the prompt, positions 0-2: one block
    out = step(scheduler, bm)  # position 3 completes block 1
    assert out.output.block_tables == {} and bm.get_block_table(seq) == [1]
    out = step(scheduler, bm)  # position 4 opens a second block
    assert plan(out) == [("a", 1)] and not out.preempted
    assert out.output.block_tables == {seq.seq_id: [1, 2]}
    probe = Sequence(scheduler.new_seq_id(), seq.token_ids[:4] + [99])
    assert bm.cached_prefix(probe) == [1]


def test_running_decodes_come_first_and_waiting_prompts_fill_the_rest():
    scheduler, bm = make_scheduler(budget=6)
    add(scheduler, "a", 3)
    step(scheduler, bm)  # a prefilled, one token sampled
    add(scheduler, "b", 10)
    out = step(scheduler, bm)
    assert plan(out) == [("a", 1), ("b", 5)]
    out = step(scheduler, bm)
    assert plan(out) == [("a", 1), ("b", 5)]
    out = step(scheduler, bm)
    assert plan(out) == [("a", 1), ("b", 1)]


def test_max_num_seqs_limits_admission():
    scheduler, bm = make_scheduler(max_num_seqs=2)
    for name in "abc":
        add(scheduler, name, 2)
    out = step(scheduler, bm)
    assert [r for r, _ in plan(out)] == ["a", "b"]
    assert [g.request_id for g in scheduler.waiting] == ["c"]


def test_preemption_frees_the_newest_group_and_recomputes_it_later():
    # 6 usable blocks of 2 tokens. a and b each hold 3 blocks after their prompts (5 tokens).
    scheduler, bm = make_scheduler(num_blocks=7, block_size=2, budget=16)
    a = add(scheduler, "a", 5, max_tokens=4)
    b = add(scheduler, "b", 5, max_tokens=4)
    step(scheduler, bm)
    assert bm.get_block_table(a.seqs[0]) == [1, 2, 3]
    assert bm.get_block_table(b.seqs[0]) == [4, 5, 6]
    assert bm.num_free_blocks == 0
    # Position 5 fits in the third blocks; position 6 needs a new block each.
    step(scheduler, bm)
    out = step(scheduler, bm)
    assert [g.request_id for g in out.preempted] == ["b"]
    assert plan(out) == [("a", 1)]
    assert b.seqs[0].status is SequenceStatus.WAITING and b.seqs[0].num_computed_tokens == 0
    assert scheduler.waiting.peek() is b and scheduler.num_preemptions == 1
    assert bm.get_block_table(a.seqs[0]) == [1, 2, 3, 4]  # b's freed blocks, lowest first
    # b keeps its generated tokens and is recomputed once a has finished.
    b_tokens = list(b.seqs[0].token_ids)
    while not a.is_finished:
        step(scheduler, bm)
    assert bm.num_free_blocks == 6
    out = step(scheduler, bm)
    assert plan(out) == [("b", len(b_tokens))]
    while scheduler.has_unfinished():
        step(scheduler, bm)
    assert b.seqs[0].token_ids[: len(b_tokens)] == b_tokens
    assert b.seqs[0].num_output_tokens == 4
    assert bm.num_free_blocks == 6


def test_a_group_preempted_with_a_token_in_flight_that_ends_it_leaves_the_waiting_queue():
    """Async scheduling: the next step is scheduled before this one's tokens come back. A
    group preempted by that scheduling, whose token still in flight is EOS, finishes while
    waiting: it must leave the queue then, not be recomputed."""
    scheduler, bm = make_scheduler(num_blocks=7, block_size=2, budget=16)
    a = add(scheduler, "a", 5, max_tokens=4)
    b = add(scheduler, "b", 5, max_tokens=4)
    step(scheduler, bm)  # both prompts: 3 blocks each, none left
    in_flight = scheduler.schedule()  # position 5 of each, in the blocks they hold
    ahead = scheduler.schedule()  # position 6 needs a block each: b, the newest, is preempted
    assert [g.request_id for g in ahead.preempted] == ["b"]
    assert list(scheduler.waiting) == [b]
    rows = [seq_id for item in in_flight.output.scheduled for seq_id in item.sample_seq_ids]
    assert rows == [a.seqs[0].seq_id, b.seqs[0].seq_id]
    scheduler.update(
        in_flight, ModelRunnerOutput(rows, SamplerOutput([11, EOS], [0.0] * 2, [None] * 2))
    )
    assert b.is_finished and b.seqs[0].status is SequenceStatus.FINISHED_STOPPED
    assert list(scheduler.waiting) == [] and scheduler.running == [a]
    rows = [seq_id for item in ahead.output.scheduled for seq_id in item.sample_seq_ids]
    scheduler.update(ahead, ModelRunnerOutput(rows, SamplerOutput([12], [0.0], [None])))
    bm.check_invariants()
    while scheduler.has_unfinished():
        step(scheduler, bm)
    assert a.seqs[0].num_output_tokens == 4 and b.seqs[0].num_output_tokens == 2
    assert bm.num_free_blocks == 6


def test_abort_frees_blocks_at_once_for_running_and_waiting_requests():
    scheduler, bm = make_scheduler(max_num_seqs=1)
    a = add(scheduler, "a", 9)
    b = add(scheduler, "b", 3)
    step(scheduler, bm)
    assert bm.num_free_blocks == 15 - 3
    scheduler.abort(a)
    bm.check_invariants()
    assert bm.num_free_blocks == 15
    assert a.seqs[0].status is SequenceStatus.FINISHED_ABORTED
    scheduler.abort(b)
    assert b.seqs[0].status is SequenceStatus.FINISHED_ABORTED
    assert not scheduler.has_unfinished()


def test_finished_sequences_give_back_their_blocks():
    scheduler, bm = make_scheduler()
    add(scheduler, "a", 7, max_tokens=3)
    add(scheduler, "b", 2, max_tokens=5)
    while scheduler.has_unfinished():
        step(scheduler, bm)
    assert bm.num_free_blocks == 15 and bm.block_tables == {}


def test_parallel_samples_fork_off_the_prompt_and_share_its_blocks():
    scheduler, bm = make_scheduler(block_size=4)
    group = add(scheduler, "a", 6, n=3, max_tokens=4)
    out = step(scheduler, bm)
    parent = group.seqs[0]
    assert len(group.seqs) == 3
    assert sampled_seqs(out, 0) == group.seqs
    tables = [bm.get_block_table(s) for s in group.seqs]
    assert tables == [[1, 2]] * 3 and bm.ref_counts[1] == 3 and bm.ref_counts[2] == 3
    assert len({s.token_ids[-1] for s in group.seqs}) == 3  # each sample drew its own token
    # Each sample writes position 6 into shared block 2: two copy it, the last owns it.
    out = step(scheduler, bm)
    assert out.output.blocks_to_copy == [(2, 3), (2, 4)]
    assert [bm.get_block_table(s) for s in group.seqs] == [[1, 3], [1, 4], [1, 2]]
    assert bm.ref_counts[1] == 3 and parent.num_computed_tokens == 7
    while scheduler.has_unfinished():
        step(scheduler, bm)
    assert all(s.num_output_tokens == 4 for s in group.seqs)
    assert bm.num_free_blocks == 15


def test_the_cached_running_count_equals_a_recount_through_forks_preemption_and_ends():
    """`num_running_seqs` is kept between steps (admission reads it): after every step of a
    mix of n > 1 forks, preemptions (few blocks), block-boundary decodes, finishes and an
    abort it equals a recount, and admission never runs more than max_num_seqs."""
    scheduler, bm = make_scheduler(num_blocks=10, block_size=4, budget=16, max_num_seqs=6)
    groups = {}
    for i, (prompt_len, n, max_tokens) in enumerate(
        [(5, 1, 9), (3, 3, 6), (7, 1, 12), (2, 2, 10), (6, 1, 5), (4, 1, 14)]
    ):
        groups[f"r{i}"] = add(scheduler, f"r{i}", prompt_len, n=n, max_tokens=max_tokens, seed=i)
    preempted = 0
    for index in range(200):
        if not scheduler.has_unfinished():
            break
        if index == 6:
            scheduler.abort(groups["r2"])
        out = step(scheduler, bm)
        preempted += len(out.preempted)
        recount = sum(g.num_unfinished_seqs for g in scheduler.running)
        assert scheduler.num_running_seqs == recount <= 6
    assert not scheduler.has_unfinished() and preempted > 0


def test_a_fork_at_the_end_of_a_chunked_prompt_is_counted_running():
    """A prompt longer than the step's budget forks its n samples in a later step, while it
    runs and nothing is admitted: the kept count sees the new samples."""
    scheduler, bm = make_scheduler(num_blocks=20, block_size=4, budget=16, max_num_seqs=6)
    add(scheduler, "r0", 22, n=3, max_tokens=4, seed=0)
    counts = []
    while scheduler.has_unfinished():
        step(scheduler, bm)
        counts.append(scheduler.num_running_seqs)
    assert counts[:2] == [1, 3]  # the first chunk alone, then the prompt's end and its forks


def test_a_prefill_interval_admits_at_most_every_n_steps_and_at_once_when_idle():
    """prefill_interval 3: a request arriving while another decodes waits until 3 steps have
    passed since the last admission (the steps between are decode-only); with nothing
    running, an arrival is admitted in the next step."""
    scheduler, bm = make_scheduler(num_blocks=32, prefill_interval=3)
    add(scheduler, "a", 5, max_tokens=30)
    assert plan(step(scheduler, bm)) == [("a", 5)]  # nothing ran: admitted at once
    add(scheduler, "b", 4, max_tokens=30)
    assert plan(step(scheduler, bm)) == [("a", 1)]
    add(scheduler, "c", 3, max_tokens=30)
    assert plan(step(scheduler, bm)) == [("a", 1)]
    # The third step since "a" was admitted: both waiting requests come in together.
    assert plan(step(scheduler, bm)) == [("a", 1), ("b", 4), ("c", 3)]
    add(scheduler, "d", 2, max_tokens=30)
    plans = [plan(step(scheduler, bm)) for _ in range(3)]
    assert plans == [
        [("a", 1), ("b", 1), ("c", 1)],
        [("a", 1), ("b", 1), ("c", 1)],
        [("a", 1), ("b", 1), ("c", 1), ("d", 2)],
    ]
    for group in list(scheduler.running):
        scheduler.abort(group)
    assert not scheduler.running
    add(scheduler, "e", 2, max_tokens=4)
    assert plan(step(scheduler, bm)) == [("e", 2)]  # idle again: no wait


def test_a_prefill_interval_of_one_admits_every_step():
    scheduler, bm = make_scheduler(num_blocks=32)
    add(scheduler, "a", 5, max_tokens=30)
    step(scheduler, bm)
    add(scheduler, "b", 4, max_tokens=30)
    assert plan(step(scheduler, bm)) == [("a", 1), ("b", 4)]
