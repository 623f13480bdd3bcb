"""Pacing of one stream's messages between Ray processes: a stream may start at once, then
sends at most one message per interval on average, each joining what was made meanwhile."""

from __future__ import annotations

# Body items a stream may send at once before pacing starts: a chat stream's role chunk and
# its first token, a completion's first two tokens, go out as soon as they are made.
PACER_BURST = 2


class Pacer:
    """A token bucket for one stream's messages: `burst` may go at once, then one per
    `interval_s` on average (0: no pacing). The caller joins what it holds back."""

    def __init__(self, interval_s: float, burst: int = PACER_BURST):
        self.interval_s = interval_s
        self.burst = burst
        self._credit = float(burst)
        self._updated: float | None = None

    def delay(self, now: float) -> float:
        """Seconds to wait before the next message may go."""
        self._refill(now)
        return 0.0 if self._credit >= 1 else (1 - self._credit) * self.interval_s

    def sent(self, now: float) -> None:
        self._refill(now)
        self._credit -= 1

    def _refill(self, now: float) -> None:
        if self.interval_s <= 0:
            self._credit = float(self.burst)
        elif self._updated is not None:
            gained = (now - self._updated) / self.interval_s
            self._credit = min(float(self.burst), self._credit + gained)
        self._updated = now
