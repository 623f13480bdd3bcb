"""Each replica's engine stats as Ray Serve metrics: Ray Serve tags them with the
application, deployment and replica, and Ray's metrics agent exports them in the Prometheus
format on every node (`ray start --metrics-export-port`), next to Ray Serve's own request
metrics. The names are those of `octavo serve`'s /metrics, with `_` for `:`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from ray.serve import metrics

from octavo.engine.core_messages import EngineStats

# How often a replica publishes: Ray's metrics agent itself reports every few seconds.
PUBLISH_PERIOD_S = 5.0

_GAUGES = {
    "octavo_num_requests_running": ("sequences running", "num_running_seqs"),
    "octavo_num_requests_waiting": ("requests waiting for admission", "num_waiting_requests"),
    "octavo_kv_cache_usage_perc": ("fraction of KV blocks in use", "kv_cache_usage"),
}
_COUNTERS = {
    "octavo_prompt_tokens_total": ("prompt tokens computed", "num_prompt_tokens"),
    "octavo_generation_tokens_total": ("tokens generated", "num_generation_tokens"),
    "octavo_num_preemptions_total": ("preemptions", "num_preemptions"),
    "octavo_prefix_cache_queries_total": ("prompt tokens looked up", "num_prefix_cache_queries"),
    "octavo_prefix_cache_hits_total": ("prompt tokens found cached", "num_prefix_cache_hits"),
    "octavo_engine_steps_total": ("engine steps run", "num_steps"),
}


class _Gauge(Protocol):
    def set(self, value: float) -> None: ...


class _Counter(Protocol):
    def inc(self, value: float = 1.0) -> None: ...


class ReplicaMetrics:
    """Gauges set to the latest stats; counters advanced by what the engine's cumulative
    counts gained since the last publish."""

    def __init__(
        self,
        gauge: Callable[..., _Gauge] = metrics.Gauge,
        counter: Callable[..., _Counter] = metrics.Counter,
    ):
        self._gauges = {
            field: gauge(name, description=text) for name, (text, field) in _GAUGES.items()
        }
        self._counters = {
            field: counter(name, description=text) for name, (text, field) in _COUNTERS.items()
        }
        self._published: dict[str, float] = dict.fromkeys(self._counters, 0)

    def publish(self, stats: EngineStats) -> None:
        for field, gauge in self._gauges.items():
            gauge.set(getattr(stats, field))
        for field, counter in self._counters.items():
            value = getattr(stats, field)
            if value > self._published[field]:
                counter.inc(value - self._published[field])
            self._published[field] = value

    async def publish_every(self, period_s: float, stats: Callable[[], EngineStats]) -> None:
        """Publishes `stats()` every `period_s` seconds until cancelled."""
        while True:
            self.publish(stats())
            await asyncio.sleep(period_s)
