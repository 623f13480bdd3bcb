"""Prometheus metrics with vLLM-style names, on a registry owned by the app (no globals)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from octavo.engine.core_messages import UserStats
from octavo.engine.frontend.async_engine import AsyncEngine
from octavo.engine.frontend.outputs import RequestMetrics

PREFIX = "octavo:"
# Seconds; TTFT and queue time span idle-to-loaded, ITL is per token.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class EngineStatsCollector(Collector):
    """Gauges and counters read from the engine's latest published stats at scrape time."""

    def __init__(self, engine: AsyncEngine, lora_names: Callable[[], dict[int, str]]):
        self.engine = engine
        self.lora_names = lora_names  # the served adapters' names by id

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
        yield _counter(
            "spec_decode_num_draft_tokens",
            "Draft tokens verified (speculative decoding).",
            stats.num_draft_tokens,
        )
        yield _counter(
            "spec_decode_num_accepted_tokens",
            "Draft tokens the model chose.",
            stats.num_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens the model chose, by position in the draft (0: the first).",
            labels=["position"],
        )
        for position, count in enumerate(stats.num_accepted_tokens_per_pos):
            per_pos.add_metric([str(position)], count)
        yield per_pos
        names = self.lora_names() if stats.lora_running or stats.lora_waiting else {}
        for kind, counts in (("running", stats.lora_running), ("waiting", stats.lora_waiting)):
            family = GaugeMetricFamily(
                PREFIX + f"lora_requests_{kind}",
                f"Requests {kind} per LoRA adapter.",
                labels=["lora_name"],
            )
            for lora_int_id, count in counts.items():
                # An adapter unloaded while its requests run keeps its id as a name.
                family.add_metric([names.get(lora_int_id, str(lora_int_id))], count)
            yield family
        yield from _user_families(stats.users)


def _user_families(users: dict[str, UserStats]):
    """Per user (the engine's bounded set of labels: each API key's user, or the first
    users by `user` field, then "other")."""
    families = (
        (GaugeMetricFamily, "user_requests_running", "Requests running per user.", "num_running"),
        (GaugeMetricFamily, "user_requests_waiting", "Requests waiting per user.", "num_waiting"),
        (
            CounterMetricFamily, "user_prompt_tokens",
            "Prompt tokens served per user (counted at first admission).", "prompt_tokens",
        ),
        (
            CounterMetricFamily, "user_generation_tokens",
            "Tokens generated per user (counted when each request ends).", "generation_tokens",
        ),
    )  # fmt: skip
    for family_type, name, doc, field in families:
        family = family_type(PREFIX + name, doc, labels=["user"])
        for user, series in users.items():
            family.add_metric([user], getattr(series, field))
        yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    """Request-latency histograms plus the engine collector, exposed by `render()`.

    With `multiprocess_dir` (prometheus-client's multiprocess mode, which several API
    processes share: --api-server-count) the histograms `render` shows are every process's,
    added up; the engine's counters are the core's, the same in every process."""

    def __init__(
        self,
        engine: AsyncEngine,
        multiprocess_dir: str | None = None,
        lora_names: Callable[[], dict[int, str]] = dict,
    ):
        self._engine_stats = EngineStatsCollector(engine, lora_names)
        self._multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        self.registry.register(self._engine_stats)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS):
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.")
        # Observed per streamed event: prometheus_client's observe costs well under a
        # microsecond, against tens of microseconds of API CPU per streamed token.
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between consecutive events of a streamed request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.")

    def observe_finished(self, metrics: RequestMetrics) -> None:
        if metrics.first_token_time is not None:
            self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        if metrics.first_scheduled_time is not None:
            self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)

    def render(self) -> bytes:
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self._multiprocess_dir)
        registry.register(self._engine_stats)
        return generate_latest(registry)
