"""Pacer: a token bucket per stream; `burst` messages at once, then one per interval."""

import pytest

from octavo.server.ray_serve.pacer import Pacer


def send_at(pacer: Pacer, now: float) -> float:
    """When the message wanted at `now` goes."""
    at = now + pacer.delay(now)
    pacer.sent(at)
    return at


def test_a_burst_goes_at_once_then_one_message_per_interval():
    pacer = Pacer(0.05, burst=2)
    assert [send_at(pacer, 0.0) for _ in range(5)] == pytest.approx([0, 0, 0.05, 0.1, 0.15])


def test_an_idle_stream_earns_its_burst_back_and_no_more():
    pacer = Pacer(0.05, burst=2)
    for _ in range(3):
        send_at(pacer, 0.0)
    # Idle for 10 intervals: credit refills to the burst, not to 10.
    sends = [send_at(pacer, 1.0) for _ in range(3)]
    assert sends == pytest.approx([1.0, 1.0, 1.05])


def test_a_slow_stream_is_never_held_back():
    pacer = Pacer(0.05, burst=2)
    for i in range(20):
        now = i * 0.06  # slower than one per interval
        assert pacer.delay(now) == 0
        pacer.sent(now)


def test_interval_zero_never_waits():
    pacer = Pacer(0.0)
    for _ in range(100):
        assert pacer.delay(0.0) == 0
        pacer.sent(0.0)
