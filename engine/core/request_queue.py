"""The waiting queue under each scheduling policy: whom the scheduler admits next, and whom it
preempts to make room (vLLM's RequestQueue and --scheduling-policy).

- fcfs: arrival order; a preempted request goes back to the front. Running requests that need
  blocks preempt the most recently admitted one; nothing is preempted to admit a request.
- priority: vLLM's: lower `priority` first, ties by arrival (a preempted request goes back in
  its place by that order). The least urgent running request is the one preempted, and one less
  urgent than the most urgent waiting request is preempted to admit it.
- fair: a virtual token counter per user (the virtual token counter of "Fairness in Serving
  Large Language Models", OSDI 2024): each user is charged for the service its requests get
  (prompt tokens when first admitted, one output token per sequence a step samples, each
  weighted), and the waiting request of the user charged least is admitted next (among
  equals, the user with the fewest waiting requests). A user that starts waiting again is
  lifted to the least charged user with unfinished requests, so time away accrues no credit.
  A user holding fewer sequence seats than its share (max_num_seqs over the users with
  unfinished requests) takes a seat of the most charged user above its share (preemption by
  recompute); the two only move toward the share, so seats never swap back and forth.

The scheduler calls `add` for a new request, `prepend` for one it took back (preempted, or
passed over this step), `peek`/`pop` to admit; `remove` and `remove_finished` drop requests.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Iterator

from octavo.engine.config import SCHEDULING_POLICIES
from octavo.engine.core.scheduled_step import CoreEntry, ScheduledFields
from octavo.engine.core.sequence import SequenceGroup

# Users whose counters the fair queue keeps once they have nothing queued: past this many, the
# idle ones are forgotten (one coming back is lifted as a new one is), so a flood of distinct
# `user` values cannot grow the table without bound.
MAX_IDLE_USERS = 4096


class RequestQueue(ABC):
    """The waiting requests in the order of a policy, and its preemption choices."""

    # Whether `admission_victim` can name a running request (the scheduler asks only then).
    preempts_to_admit = False

    @abstractmethod
    def add(self, group: SequenceGroup, running: list[SequenceGroup]) -> None:
        """Queues a new request (`running`: the running requests, for a policy that reads
        them)."""

    @abstractmethod
    def prepend(self, group: SequenceGroup) -> None:
        """Queues again a request that was taken off the queue (preempted, or passed over):
        ahead of every request that came after it."""

    @abstractmethod
    def peek(self) -> SequenceGroup:
        """The request to admit next (the queue is not empty)."""

    @abstractmethod
    def pop(self) -> SequenceGroup:
        """Takes the request `peek` names off the queue."""

    @abstractmethod
    def remove(self, group: SequenceGroup) -> None: ...

    def remove_finished(self) -> None:
        """Drops the finished requests (preempted ones a late token finished: rare, so each
        goes by `remove`)."""
        for group in [group for group in self if group.is_finished]:
            self.remove(group)

    @abstractmethod
    def __iter__(self) -> Iterator[SequenceGroup]: ...

    @abstractmethod
    def __len__(self) -> int:
        """The waiting requests (also the queue's truth: empty is false)."""

    def preemption_victim(self, candidates: list[SequenceGroup]) -> SequenceGroup:
        """Which of `candidates` (running requests not yet scheduled this step, in admission
        order) to preempt when a running request finds no blocks: the last admitted."""
        return candidates[-1]

    def admission_victim(
        self, candidate: SequenceGroup, running: list[SequenceGroup], max_num_seqs: int
    ) -> SequenceGroup | None:
        """A running request to preempt so that `candidate` (`peek`'s) can be admitted, or
        None to let it wait."""
        return None

    def charge(self, group: SequenceGroup, num_prompt_tokens: int) -> None:
        """A request admitted for the first time, with its prompt: only fair charges."""
        return None

    def charge_step(self, scheduled: list[ScheduledFields], entries: list[CoreEntry]) -> None:
        """The step just scheduled (its sequences and their core entries, in order): only
        fair charges."""
        return None


def create_request_queue(
    policy: str, prompt_token_weight: float = 1.0, output_token_weight: float = 2.0
) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    if policy == "fair":
        return FairRequestQueue(prompt_token_weight, output_token_weight)
    raise ValueError(
        f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, got {policy!r}"
    )


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[SequenceGroup] = deque()

    def add(self, group: SequenceGroup, running: list[SequenceGroup]) -> None:
        self._queue.append(group)

    def prepend(self, group: SequenceGroup) -> None:
        self._queue.appendleft(group)

    def peek(self) -> SequenceGroup:
        return self._queue[0]

    def pop(self) -> SequenceGroup:
        return self._queue.popleft()

    def remove(self, group: SequenceGroup) -> None:
        self._queue.remove(group)  # a scan in C: a burst of aborts stays cheap

    def __iter__(self) -> Iterator[SequenceGroup]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


def _urgency(group: SequenceGroup) -> tuple[int, float]:
    """The priority policy's order: lower priority first, then earlier arrival."""
    return group.priority, group.arrival_time


class PriorityRequestQueue(RequestQueue):
    preempts_to_admit = True

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, SequenceGroup]] = []
        self._order = itertools.count()  # never compare groups

    def add(self, group: SequenceGroup, running: list[SequenceGroup]) -> None:
        self.prepend(group)

    def prepend(self, group: SequenceGroup) -> None:
        heapq.heappush(self._heap, (*_urgency(group), next(self._order), group))

    def peek(self) -> SequenceGroup:
        return self._heap[0][-1]

    def pop(self) -> SequenceGroup:
        return heapq.heappop(self._heap)[-1]

    def remove(self, group: SequenceGroup) -> None:
        self._heap = [entry for entry in self._heap if entry[-1] is not group]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[SequenceGroup]:
        return (entry[-1] for entry in sorted(self._heap))

    def __len__(self) -> int:
        return len(self._heap)

    def preemption_victim(self, candidates: list[SequenceGroup]) -> SequenceGroup:
        return max(reversed(candidates), key=_urgency)  # the least urgent, latest on a tie

    def admission_victim(
        self, candidate: SequenceGroup, running: list[SequenceGroup], max_num_seqs: int
    ) -> SequenceGroup | None:
        if not running:
            return None
        victim = max(reversed(running), key=_urgency)
        return victim if _urgency(victim) > _urgency(candidate) else None


class FairRequestQueue(RequestQueue):
    """Per user (`SequenceGroup.user`) a queue in arrival order and a virtual token counter."""

    preempts_to_admit = True

    def __init__(self, prompt_token_weight: float, output_token_weight: float) -> None:
        self.prompt_token_weight = prompt_token_weight
        self.output_token_weight = output_token_weight
        self.counters: dict[str, float] = {}
        self._queues: dict[str, deque[SequenceGroup]] = {}
        self._len = 0

    def add(self, group: SequenceGroup, running: list[SequenceGroup]) -> None:
        user = group.user
        running_users = {g.user for g in running}
        if user not in self._queues and user not in running_users:
            active = [self.counters.get(u, 0.0) for u in (*self._queues, *running_users)]
            floor = min(active, default=self.counters.get(user, 0.0))
            self.counters[user] = max(self.counters.get(user, 0.0), floor)
            if len(self.counters) > MAX_IDLE_USERS + len(active):
                keep = {user, *self._queues, *running_users}
                self.counters = {u: c for u, c in self.counters.items() if u in keep}
        self._queues.setdefault(user, deque()).append(group)
        self._len += 1

    def prepend(self, group: SequenceGroup) -> None:
        self._queues.setdefault(group.user, deque()).appendleft(group)
        self._len += 1

    def _next_user(self) -> str:
        """The least charged user with a waiting request; among equals (a user lifted to the
        least charged one ties it), the one with the fewest waiting, then the earlier head
        arrival: a returning interactive user goes before a backlogged one."""
        queues = self._queues
        return min(
            queues,
            key=lambda u: (self.counters.get(u, 0.0), len(queues[u]), queues[u][0].arrival_time),
        )

    def peek(self) -> SequenceGroup:
        return self._queues[self._next_user()][0]

    def pop(self) -> SequenceGroup:
        group = self.peek()
        self.remove(group)  # the head of its user's queue: found at once
        return group

    def remove(self, group: SequenceGroup) -> None:
        queue = self._queues[group.user]
        queue.remove(group)
        if not queue:
            del self._queues[group.user]
        self._len -= 1

    def __iter__(self) -> Iterator[SequenceGroup]:
        return (group for queue in self._queues.values() for group in queue)

    def __len__(self) -> int:
        return self._len

    def preemption_victim(self, candidates: list[SequenceGroup]) -> SequenceGroup:
        """The latest admitted request of the most charged user among `candidates`."""
        return max(reversed(candidates), key=lambda g: self.counters.get(g.user, 0.0))

    def admission_victim(
        self, candidate: SequenceGroup, running: list[SequenceGroup], max_num_seqs: int
    ) -> SequenceGroup | None:
        seats: Counter[str] = Counter()
        for group in running:
            seats[group.user] += group.num_unfinished_seqs
        share = max_num_seqs / len({*seats, *self._queues})
        user = candidate.user
        if seats[user] >= share:
            return None
        counter = self.counters.get(user, 0.0)
        above = [u for u, n in seats.items() if n > share and self.counters.get(u, 0.0) >= counter]
        if not above:
            return None
        victim_user = max(above, key=lambda u: self.counters.get(u, 0.0))
        return next(g for g in reversed(running) if g.user == victim_user)

    def charge(self, group: SequenceGroup, num_prompt_tokens: int) -> None:
        user = group.user
        self.counters[user] = (
            self.counters.get(user, 0.0) + self.prompt_token_weight * num_prompt_tokens
        )

    def charge_step(self, scheduled: list[ScheduledFields], entries: list[CoreEntry]) -> None:
        weight, counters = self.output_token_weight, self.counters
        for fields, (group, _, sampled) in zip(scheduled, entries, strict=True):
            # A beam search's position samples one token per live beam.
            num_outputs = len(sampled) or (1 if len(fields) > 5 and fields[5] else 0)
            if num_outputs:
                counters[group.user] = counters.get(group.user, 0.0) + weight * num_outputs
