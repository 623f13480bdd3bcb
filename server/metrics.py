"""Prometheus metrics with vLLM-style names, on a registry owned by the app (no globals)."""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
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


class LatencyHistogram(Collector):
    """A histogram whose counts this collector owns: `add` counts a batch of values, and a
    scrape shows what prometheus_client's `Histogram(name, documentation, buckets=bounds)`
    would show after observing the same values one by one, in the same order: its buckets
    (a value on a bound counts in that bound's bucket), count, sum and creation time (which
    that Histogram shows unless prometheus_client's created series are disabled; octavo
    leaves them on).

    A collector rather than `Histogram.observe` because every streamed event of every request
    lands here: `observe` takes a lock for the sum and another for the bucket, and walks the
    bounds in Python, per value: 0.73 us, against 0.16 us for a stream's append and this
    batch's share (one lock a batch, a bisect a value), measured on this project's CPU VM.
    Its counts are this process's only: with several API processes (prometheus_client's
    multiprocess mode) use `Histogram.observe`, whose values the other processes' scrapes
    read."""

    def __init__(self, name: str, documentation: str, bounds: Sequence[float]):
        self._name = name
        self._documentation = documentation
        self._bounds = tuple(bounds)
        # The `le` labels as prometheus_client's Histogram writes them: Go's format, which
        # is Python's repr ("0.001", "1.0") for bounds under 1e6 (the test compares them).
        self._labels = [repr(float(bound)) for bound in self._bounds] + ["+Inf"]
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()

    def add(self, values: Iterable[float]) -> None:
        """Counts each value, as `Histogram.observe(value)` would."""
        bounds, counts = self._bounds, self._counts
        with self._lock:
            for value in values:
                # The first bound >= the value: a bucket holds what is <= its bound.
                counts[bisect.bisect_left(bounds, value)] += 1
                self._sum += value

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cumulative = list(itertools.accumulate(self._counts))
            total = self._sum
        family = HistogramMetricFamily(
            self._name,
            self._documentation,
            buckets=list(zip(self._labels, cumulative, strict=True)),
            sum_value=total,
        )
        family.add_sample(self._name + "_created", {}, self._created)
        yield family


class InterTokenLatencies:
    """One stream's inter-token latencies on their way to the server's histogram.

    `observe` only appends (the stream's events are the hot path); the latencies go to the
    histogram, `record(latencies)`, every ITL_FLUSH_EVENTS of them and on `flush`, which the
    stream's end calls."""

    __slots__ = ("_record", "_latencies")

    def __init__(self, record: Callable[[list[float]], None]):
        self._record = record
        self._latencies: list[float] = []

    def observe(self, seconds: float) -> None:
        self._latencies.append(seconds)
        if len(self._latencies) == ITL_FLUSH_EVENTS:
            self.flush()

    def flush(self) -> None:
        """Records what was observed since the last flush."""
        if self._latencies:
            self._record(self._latencies)
            self._latencies = []


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
        itl_name = PREFIX + "inter_token_latency_seconds"
        itl_doc = "Time between consecutive events of a streamed request."
        self._record_itl: Callable[[list[float]], None]
        if multiprocess_dir is None:
            itl = LatencyHistogram(itl_name, itl_doc, ITL_BUCKETS)
            self.registry.register(itl)
            self._record_itl = itl.add
        else:
            # Several API processes: a value reaches the files that every process's scrape
            # adds up only through a metric's own `observe` (1.8 us a value, measured).
            shared = Histogram(itl_name, itl_doc, buckets=ITL_BUCKETS, registry=self.registry)

            def observe_each(latencies: list[float]) -> None:
                for seconds in latencies:
                    shared.observe(seconds)

            self._record_itl = observe_each
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
        return InterTokenLatencies(self._record_itl)

    def render(self) -> bytes:
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self._multiprocess_dir)
        registry.register(self._engine_stats)
        return generate_latest(registry)
