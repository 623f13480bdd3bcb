"""The CPU peer benchmark runs on the smoke model without its peers' venvs: every Octavo
setting and HF report a speed, Octavo float32's tokens are HF float32's, `octavo serve`
serves the load test, and a missing peer is left out rather than fatal. Each figure agrees
with the ones it is computed from."""

import json
import statistics

import pytest

from benchmarks import common, cpu_peers
from benchmarks.peer_systems import OCTAVO_SETTINGS

pytestmark = pytest.mark.slow

# load_test.py's latency statistics, in the order they grow.
ORDERED_STATS = ("median_ms", "p90_ms", "p99_ms")


def check_latencies(served: dict) -> None:
    """load_test's summary of 2 requests of SMOKE_TOKENS tokens each."""
    for name in ("ttft", "tpot", "itl", "e2el"):
        stats = served[name]
        assert set(stats) == {"mean_ms", *ORDERED_STATS}, name
        if name == "itl" and all(value is None for value in stats.values()):
            continue  # every stream's tokens in one chunk: a stream behind gets them merged
        ordered = [stats[key] for key in ORDERED_STATS]
        assert 0 <= ordered[0] <= ordered[1] <= ordered[2], name
        # Fewer than 100 values: the p99 is the largest, at least their mean.
        assert stats["mean_ms"] <= stats["p99_ms"], name
    assert served["ttft"]["median_ms"] > 0
    # Per request, the first token comes before the end; so does each order statistic.
    for key in ("mean_ms", *ORDERED_STATS):
        assert served["ttft"][key] <= served["e2el"][key], key
    # A request's time per output token after its first: (e2el - ttft) / (tokens - 1).
    assert served["tpot"]["p99_ms"] <= served["e2el"]["p99_ms"] / (cpu_peers.SMOKE_TOKENS - 1)
    # Every token arrived within the pass, which lasted at least the slowest request.
    tokens = cpu_peers.SMOKE_REQUESTS * cpu_peers.SMOKE_TOKENS
    assert served["output_token_throughput"] * served["e2el"]["p99_ms"] / 1e3 <= tokens


@pytest.mark.slow
def test_smoke_run_reports_every_system_and_float32_matches_hf(tmp_path):
    result_file = tmp_path / "peers.json"
    cpu_peers.main(["--smoke", "--result-file", str(result_file)])
    check_smoke_result(json.loads(result_file.read_text()))


def check_smoke_result(result: dict) -> None:
    assert result["benchmark"] == "cpu_peers" and result["smoke"] is True
    assert list(result["workloads"]) == list(cpu_peers.WORKLOADS)
    workloads = dict(result["workloads"])
    for name, concurrency in cpu_peers.SERVED_CONCURRENCY.items():
        served = workloads.pop(name)
        assert served["concurrency"] == concurrency
        names = [s["system"] for s in served["systems"]]
        assert names == list(cpu_peers.SERVED_OCTAVO[name]), name  # no peer given
        for alone in served["systems"]:
            assert set(alone) == {"system", *cpu_peers.SERVED_FIELDS}
            assert alone["completed"] == cpu_peers.SMOKE_REQUESTS and alone["failed"] == 0
            check_latencies(alone)
    smoke_shape = dict(zip(("n_layer", "n_embd", "n_head"), common.SMOKE_PRESET, strict=True))
    for name, workload in workloads.items():
        beam_width = cpu_peers.WORKLOADS[name][4]
        prompts, max_tokens = cpu_peers.make_requests(name, 0, smoke=True)
        assert workload["shape"] == smoke_shape, name
        assert workload["beam_width"] == beam_width, name
        assert workload["requests"] == len(prompts) == cpu_peers.SMOKE_REQUESTS, name
        assert workload["prompt_tokens"] == sum(map(len, prompts)), name
        assert workload["output_tokens"] == sum(max_tokens), name
        assert sum(max_tokens) == cpu_peers.SMOKE_REQUESTS * cpu_peers.SMOKE_TOKENS
        names = [s["system"] for s in workload["systems"]]
        if beam_width:
            assert names == ["octavo float32"], name
        else:
            assert names == [*OCTAVO_SETTINGS, "hf float32"], name
        systems = {s["system"]: s for s in workload["systems"]}
        for system, row in systems.items():
            assert "outputs" not in row  # the token lists are compared, then dropped
            # --smoke: one timed run, which is the median.
            assert len(row["wall_s_runs"]) == 1, system
            assert row["wall_s"] == statistics.median(row["wall_s_runs"]) > 0, system
            speed = workload["output_tokens"] / row["wall_s"]
            assert row["output_tokens_per_s"] == pytest.approx(speed, rel=1e-9), system
            if system in OCTAVO_SETTINGS:
                assert row["settings"] == OCTAVO_SETTINGS[system], system
            # Its speed over every other system's, each named once.
            others = {s: r["output_tokens_per_s"] for s, r in systems.items() if s != system}
            assert set(row["ratio_to"]) == set(others), system
            for other, other_speed in others.items():
                ratio = row["output_tokens_per_s"] / other_speed
                assert row["ratio_to"][other] == pytest.approx(ratio, rel=1e-9), (system, other)
        # Greedy float32 tokens: Octavo's (and HF's, without beams) equal Octavo float32's.
        requests = workload["requests"]
        float32 = [s for s in systems if s.endswith("float32")]
        assert float32 == (["octavo float32"] if beam_width else ["octavo float32", "hf float32"])
        for system in float32:
            assert systems[system]["same_tokens_as_octavo_float32"] == f"{requests} of {requests}"
        for system in systems.keys() - set(float32):
            assert "same_tokens_as_octavo_float32" not in systems[system], system
