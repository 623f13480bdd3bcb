"""The server's latency histograms: counts gathered per request expose as prometheus's own
Histogram.observe of the same values would."""

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from octavo.server.metrics import ITL_BUCKETS, InterTokenLatencies, ServerMetrics

# Below, on and between the bounds, and past the last.
LATENCIES = [0.0, 0.0005, 0.001, 0.0010001, 0.003, 0.025, 0.7, 2.5, 2.6, 100.0]


def _itl_samples(exposition: bytes) -> list[str]:
    """The ITL histogram's lines, but when it was created."""
    lines = exposition.decode().splitlines()
    return [line for line in lines if "inter_token" in line and "_created" not in line]


class _Engine:
    """What ServerMetrics' engine collector reads (nothing, unregistered below)."""


@pytest.mark.parametrize("split", [1, 3, len(LATENCIES)])
def test_inter_token_latencies_expose_as_observed_one_by_one(split):
    """The oracle: a prometheus Histogram with the same name and bounds, observed one value
    at a time. Latencies arrive as several requests' (`split` per request)."""
    metrics = ServerMetrics(_Engine())  # type: ignore[arg-type]
    metrics.registry.unregister(metrics._engine_stats)
    for start in range(0, len(LATENCIES), split):
        request = InterTokenLatencies()
        for seconds in LATENCIES[start : start + split]:
            request.observe(seconds)
        metrics.add_itl(request)
    reference = CollectorRegistry()
    histogram = Histogram(
        "octavo:inter_token_latency_seconds",
        "Time between consecutive events of a streamed request.",
        buckets=ITL_BUCKETS,
        registry=reference,
    )
    for seconds in LATENCIES:
        histogram.observe(seconds)
    ours = _itl_samples(metrics.render())
    assert ours == _itl_samples(generate_latest(reference))
    assert any(line.endswith(f" {len(LATENCIES)}.0") for line in ours)
