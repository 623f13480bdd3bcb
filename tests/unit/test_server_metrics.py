"""The server's latency histograms: counts gathered per stream expose as prometheus's own
Histogram.observe of the same values would."""

import re

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from octavo.server.metrics import _LATENCY_BUCKETS, ITL_BUCKETS, ITL_FLUSH_EVENTS, ServerMetrics

# Below, on and between the bounds, and past the last.
LATENCIES = [0.0, 0.0005, 0.001, 0.0010001, 0.003, 0.025, 0.7, 2.5, 2.6, 100.0]


class _Engine:
    """What ServerMetrics' engine collector reads (nothing: it is unregistered)."""


def _metrics() -> ServerMetrics:
    metrics = ServerMetrics(_Engine())  # type: ignore[arg-type]
    metrics.registry.unregister(metrics._engine_stats)
    return metrics


def _observed_one_by_one(latencies: list[float]) -> dict[str, float]:
    """The oracle: a prometheus Histogram with the same name and bounds, observed one value
    at a time."""
    reference = CollectorRegistry()
    histogram = Histogram(
        "octavo:inter_token_latency_seconds",
        "Time between consecutive events of a streamed request.",
        buckets=ITL_BUCKETS,
        registry=reference,
    )
    for seconds in latencies:
        histogram.observe(seconds)
    return _itl_samples(generate_latest(reference))


def _itl_samples(exposition: bytes) -> dict[str, float]:
    """The ITL histogram's samples, but when it was created. The sum compares as a float
    (it is added in another order); the bucket counts are integers, exact either way."""
    samples = {}
    for line in exposition.decode().splitlines():
        if line.startswith("octavo:inter_token") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@pytest.mark.parametrize("per_stream", [1, 3, len(LATENCIES)])
def test_inter_token_latencies_expose_as_observed_one_by_one(per_stream):
    """Latencies of several streams (`per_stream` each), each stream flushed at its end."""
    metrics = _metrics()
    for start in range(0, len(LATENCIES), per_stream):
        stream = metrics.inter_token_latencies()
        for seconds in LATENCIES[start : start + per_stream]:
            stream.observe(seconds)
        stream.flush()
    ours = _itl_samples(metrics.render())
    assert ours == pytest.approx(_observed_one_by_one(LATENCIES))
    assert ours["octavo:inter_token_latency_seconds_count"] == len(LATENCIES)


def test_a_long_streams_latencies_show_while_it_runs():
    """Every ITL_FLUSH_EVENTS latencies reach the histogram without waiting for the end."""
    metrics = _metrics()
    stream = metrics.inter_token_latencies()
    latencies = [LATENCIES[i % len(LATENCIES)] for i in range(2 * ITL_FLUSH_EVENTS + 5)]
    for seconds in latencies:
        stream.observe(seconds)
    shown = _itl_samples(metrics.render())
    assert shown == pytest.approx(_observed_one_by_one(latencies[: 2 * ITL_FLUSH_EVENTS]))
    stream.flush()
    stream.flush()  # a second flush adds nothing
    assert _itl_samples(metrics.render()) == pytest.approx(_observed_one_by_one(latencies))


def _reference_exposition(latencies: list[float]) -> bytes:
    """/metrics as it was when every histogram was prometheus_client's own Histogram, the
    inter-token one observed one value at a time (the engine's collector left out)."""
    reference = CollectorRegistry()
    histograms = [
        ("time_to_first_token_seconds", "Arrival to first generated token.", _LATENCY_BUCKETS),
        (
            "inter_token_latency_seconds",
            "Time between consecutive events of a streamed request.",
            ITL_BUCKETS,
        ),
        ("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS),
        ("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS),
    ]
    for name, documentation, bounds in histograms:
        histogram = Histogram("octavo:" + name, documentation, buckets=bounds, registry=reference)
        if name == "inter_token_latency_seconds":
            for seconds in latencies:
                histogram.observe(seconds)
    return generate_latest(reference)


def _creation_times_masked(exposition: bytes) -> str:
    """The exposition with each `_created` sample's value (a clock reading) replaced."""
    return re.sub(r"(_created) \S+$", r"\1 <time>", exposition.decode(), flags=re.MULTILINE)


def test_the_exposition_is_prometheus_histograms_text():
    """Every line of /metrics (HELP, TYPE, each bucket's `le`, count, sum, created) is what
    prometheus_client's Histogram gave for the same values in the same order, the sum to the
    last bit; only the creation times differ."""
    metrics = _metrics()
    for start in range(0, len(LATENCIES), 3):
        stream = metrics.inter_token_latencies()
        for seconds in LATENCIES[start : start + 3]:
            stream.observe(seconds)
        stream.flush()
    ours = _creation_times_masked(metrics.render())
    assert "octavo:inter_token_latency_seconds_created <time>" in ours
    assert ours == _creation_times_masked(_reference_exposition(LATENCIES))
