"""Per-user stats (user_stats.py) through the scheduler with a fake model: each user's running
and waiting requests and the tokens it was served, the bounded set of series, and how often
the counts are taken."""

from octavo.engine.core.user_stats import OTHER_USER, UserStatsTracker
from octavo.engine.core_messages import UserStats
from tests.engine.core.test_request_queue import add, make_scheduler, step


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler_with_clock(max_num_seqs=2, max_series=64):
    scheduler, bm = make_scheduler("fcfs", max_num_seqs=max_num_seqs)
    clock = FakeClock()
    scheduler.users = UserStatsTracker(max_series, refresh_seconds=1.0, clock=clock)
    return scheduler, bm, clock


def stats_of(scheduler):
    return scheduler.users.stats(scheduler.running, scheduler.waiting)


def test_running_waiting_and_tokens_served_per_user():
    scheduler, bm, clock = scheduler_with_clock(max_num_seqs=2)
    add(scheduler, "a0", prompt_len=4, max_tokens=3, user="alice")
    add(scheduler, "a1", prompt_len=4, max_tokens=3, user="alice")
    add(scheduler, "b0", prompt_len=6, max_tokens=2, user="bob")
    step(scheduler, bm)  # the two seats: alice's two prompts
    clock.now += 1.0
    assert stats_of(scheduler) == {
        "alice": UserStats(num_running=2, num_waiting=0, prompt_tokens=8, generation_tokens=0),
        "bob": UserStats(num_running=0, num_waiting=1, prompt_tokens=0, generation_tokens=0),
    }
    while scheduler.has_unfinished():
        step(scheduler, bm)
    # Idle: counted again whatever the clock says, each request's tokens credited once.
    assert stats_of(scheduler) == {
        "alice": UserStats(0, 0, prompt_tokens=8, generation_tokens=6),
        "bob": UserStats(0, 0, prompt_tokens=6, generation_tokens=2),
    }


def test_an_aborted_request_is_credited_what_it_generated():
    scheduler, bm, _ = scheduler_with_clock()
    group = add(scheduler, "r", prompt_len=4, max_tokens=8, user="alice")
    step(scheduler, bm)
    step(scheduler, bm)
    scheduler.abort(group)
    waiting = add(scheduler, "w", prompt_len=5, max_tokens=8, user="bob")
    scheduler.abort(waiting)  # never admitted: no prompt served
    assert stats_of(scheduler) == {
        "alice": UserStats(0, 0, prompt_tokens=4, generation_tokens=2),
        "bob": UserStats(0, 0, prompt_tokens=0, generation_tokens=0),
    }


def test_counts_are_taken_at_most_every_refresh_while_requests_are_queued():
    scheduler, bm, clock = scheduler_with_clock(max_num_seqs=1)
    add(scheduler, "a", max_tokens=50, user="alice")
    first = stats_of(scheduler)
    assert first["alice"].num_waiting == 1
    step(scheduler, bm)
    assert stats_of(scheduler) is first  # within the interval: the same snapshot
    clock.now += 1.0
    assert stats_of(scheduler)["alice"] == UserStats(1, 0, 4, 0)


def test_users_past_the_bound_share_the_other_series():
    scheduler, bm, clock = scheduler_with_clock(max_num_seqs=8, max_series=2)
    for i in range(6):
        add(scheduler, f"r{i}", prompt_len=4, max_tokens=1, user=f"user{i}")
    while scheduler.has_unfinished():
        step(scheduler, bm)
    stats = stats_of(scheduler)
    assert set(stats) == {"user0", "user1", OTHER_USER}
    assert stats[OTHER_USER] == UserStats(0, 0, prompt_tokens=16, generation_tokens=4)
    # A series once given stays with its user: a newcomer cannot take it.
    add(scheduler, "late", prompt_len=4, max_tokens=1, user="user9")
    step(scheduler, bm)
    clock.now += 1.0
    assert set(stats_of(scheduler)) == {"user0", "user1", OTHER_USER}
