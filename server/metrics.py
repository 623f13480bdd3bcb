"""Prometheus metrics with vLLM-style names, on a registry owned by the app (no globals)."""

from __future__ import annotations

import bisect

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from octavo.engine.frontend.async_engine import AsyncEngine
from octavo.engine.frontend.outputs import RequestMetrics

PREFIX = "octavo:"
# Seconds; TTFT and queue time span idle-to-loaded, ITL is per token.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


# A stream's inter-token latencies reach the histogram every this many (and at its end):
# a long stream shows in /metrics while it runs, at a small share of a bulk add per event.
ITL_FLUSH_EVENTS = 64


class _CountedHistogram(Histogram):
    """A Histogram that also takes counts gathered elsewhere (InterTokenLatencies).

    prometheus-client has no public call for adding counts in bulk, so `add` increments the
    histogram's own per-bucket and sum values, which are what every exposition (single- or
    multiprocess) reads: the same values `observe` increments."""

    def add(self, counts: list[int], total: float) -> None:
        self._sum.inc(total)
        for bucket, count in zip(self._buckets, counts, strict=True):
            if count:
                bucket.inc(count)


class InterTokenLatencies:
    """One stream's inter-token latencies on their way to the server's histogram.

    Each is counted into its bucket here (a list index and two additions: the histogram's
    own `observe` takes a lock and walks the buckets in Python, on every event), and the
    counts are added to the histogram every ITL_FLUSH_EVENTS latencies and by `flush`,
    which the stream's end calls."""

    __slots__ = ("_histogram", "_counts", "_total", "_pending")

    def __init__(self, histogram: _CountedHistogram):
        self._histogram = histogram
        self._reset()

    def _reset(self) -> None:
        self._counts = [0] * (len(ITL_BUCKETS) + 1)  # the last: above every bound (+Inf)
        self._total = 0.0
        self._pending = 0

    def observe(self, seconds: float) -> None:
        # A bucket holds what is <= its bound, as prometheus counts: the first bound >= it.
        self._counts[bisect.bisect_left(ITL_BUCKETS, seconds)] += 1
        self._total += seconds
        self._pending += 1
        if self._pending == ITL_FLUSH_EVENTS:
            self.flush()

    def flush(self) -> None:
        """Adds what was observed since the last flush to the histogram."""
        if self._pending:
            self._histogram.add(self._counts, self._total)
            self._reset()


class EngineStatsCollector(Collector):
    """Gauges and counters read from the engine's latest published stats at scrape time."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        yield _gauge("num_requests_running", "Sequences being computed.", stats.num_running_seqs)
        yield _gauge(
            "num_requests_waiting", "Requests waiting to be scheduled.", self.engine.num_waiting
        )
        yield _gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", stats.kv_cache_usage
        )
        yield _counter("num_preemptions", "Preemptions by recompute.", stats.num_preemptions)
        yield _counter("prompt_tokens", "Prompt tokens admitted.", stats.num_prompt_tokens)
        yield _counter("generation_tokens", "Tokens generated.", stats.num_generation_tokens)
        yield _counter(
            "prefix_cache_queries", "Tokens looked up in the prefix cache.",
            stats.num_prefix_cache_queries,
        )  # fmt: skip
        yield _counter(
            "prefix_cache_hits", "Tokens found in the prefix cache.", stats.num_prefix_cache_hits
        )
        yield _counter("engine_steps", "Engine steps run (model forward passes).", stats.num_steps)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    """Request-latency histograms plus the engine collector, exposed by `render()`.

    With `multiprocess_dir` (prometheus-client's multiprocess mode, which several API
    processes share: --api-server-count) the histograms `render` shows are every process's,
    added up; the engine's counters are the core's, the same in every process."""

    def __init__(self, engine: AsyncEngine, multiprocess_dir: str | None = None):
        self._engine_stats = EngineStatsCollector(engine)
        self._multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        self.registry.register(self._engine_stats)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._itl = _CountedHistogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive events of a streamed request.",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to finish.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Arrival to first scheduled.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe_finished(self, metrics: RequestMetrics) -> None:
        if metrics.first_token_time is not None:
            self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)

    def inter_token_latencies(self) -> InterTokenLatencies:
        """Where one stream observes its inter-token latencies (flush it at the end)."""
        return InterTokenLatencies(self._itl)

    def render(self) -> bytes:
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self._multiprocess_dir)
        registry.register(self._engine_stats)
        return generate_latest(registry)
