"""A replica's engine stats published as Ray Serve metrics: gauges set, counters advanced by
what the engine's cumulative counts gained (never twice, never backwards)."""

from octavo.engine.core_messages import EngineStats
from octavo.server.ray_serve.replica_metrics import ReplicaMetrics


class Recorded:
    def __init__(self, name: str, description: str = ""):
        self.name, self.value = name, 0.0
        recorded[name] = self

    def set(self, value: float) -> None:
        self.value = value

    def inc(self, value: float = 1.0) -> None:
        assert value > 0
        self.value += value


recorded: dict[str, Recorded] = {}


def stats(running: int, generated: int, hits: int) -> EngineStats:
    return EngineStats(
        num_running_seqs=running, num_waiting_requests=1, num_free_blocks=10,
        num_usable_blocks=20, kv_cache_usage=0.5, num_preemptions=0, num_prompt_tokens=40,
        num_generation_tokens=generated, num_requests_added=3, num_prefix_cache_queries=64,
        num_prefix_cache_hits=hits, num_steps=generated // 2,
    )  # fmt: skip


def test_gauges_follow_the_engine_and_counters_add_what_it_gained():
    metrics = ReplicaMetrics(gauge=Recorded, counter=Recorded)
    metrics.publish(stats(running=4, generated=100, hits=16))
    metrics.publish(stats(running=2, generated=130, hits=16))
    metrics.publish(stats(running=2, generated=130, hits=48))
    assert recorded["octavo_num_requests_running"].value == 2
    assert recorded["octavo_kv_cache_usage_perc"].value == 0.5
    assert recorded["octavo_generation_tokens_total"].value == 130
    assert recorded["octavo_prefix_cache_hits_total"].value == 48
    assert recorded["octavo_prompt_tokens_total"].value == 40
    assert recorded["octavo_engine_steps_total"].value == 65
