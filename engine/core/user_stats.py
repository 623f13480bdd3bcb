"""Per-user load and service for metrics and the per-user waiting limit: each user's running and
waiting requests and the prompt and generated tokens it was served.

A request's user is what the server says (`SequenceGroup.user`: its API key's user, or its
`user` field; "" for none). The table is bounded whatever users come: the first
`max_series` users keep a series of their own for the engine's life (a series that moved to
another user would make its counters jump), every later one is counted under `OTHER_USER`.
A server's keys are far fewer than that, so each key keeps its own series.

Tokens are counted when they are served: a prompt when its request is first admitted, the
generated tokens when the request ends (finished, aborted or failed). The running and waiting
counts are recounted at most every `refresh_seconds` (a pass over every queued request, too
dear for every step), so they lag the queues by that much, and whenever nothing is queued (an
idle engine's last counts are exact).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable

from octavo.engine.core.sequence import SequenceGroup
from octavo.engine.core_messages import UserStats

# The label of the users past `max_series` (a user who calls itself this shares it).
OTHER_USER = "other"
MAX_USER_SERIES = 64
REFRESH_SECONDS = 0.1


class UserStatsTracker:
    """The scheduler's per-user counts: told of each first admission and each end, asked for
    the per-label stats with every step's EngineStats."""

    def __init__(
        self,
        max_series: int = MAX_USER_SERIES,
        refresh_seconds: float = REFRESH_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_series = max_series
        self.refresh_seconds = refresh_seconds
        self._clock = clock
        self._tokens: dict[str, list[int]] = {}  # label -> [prompt tokens, generated tokens]
        self._snapshot: dict[str, UserStats] = {}
        self._next_refresh = -float("inf")

    def label(self, user: str) -> str:
        """The series `user` is counted under (given one, if one is left)."""
        if user not in self._tokens:
            if len(self._tokens) >= self.max_series:
                user = OTHER_USER
            self._tokens.setdefault(user, [0, 0])
        return user

    def admitted(self, group: SequenceGroup) -> None:
        """A request admitted for the first time: its prompt is served."""
        self._tokens[self.label(group.user)][0] += len(group.prompt_token_ids)

    def ended(self, group: SequenceGroup) -> None:
        """A request left the engine: its generated tokens are served."""
        generated = sum(seq.num_output_tokens for seq in group.seqs)
        self._tokens[self.label(group.user)][1] += generated

    def stats(
        self, running: Iterable[SequenceGroup], waiting: Iterable[SequenceGroup]
    ) -> dict[str, UserStats]:
        """Per series label, its counts: recounted if `refresh_seconds` have passed since the
        last recount or nothing is queued, else the last one's (the same dict: treat it as
        read-only)."""
        now = self._clock()
        if now < self._next_refresh and (running or waiting):
            return self._snapshot
        self._next_refresh = now + self.refresh_seconds
        # (label, 0) per running request, (label, 1) per waiting one; every label is in
        # `_tokens` once counted.
        counts = Counter(
            (self.label(group.user), kind)
            for groups, kind in ((running, 0), (waiting, 1))
            for group in groups
        )
        self._snapshot = {
            label: UserStats(counts[label, 0], counts[label, 1], *tokens)
            for label, tokens in self._tokens.items()
        }
        return self._snapshot
