"""The soak benchmark runs briefly in both shapes: every request it sends succeeds, the
server ends idle with every KV block free, and the JSON carries the memory the README's
table reads, each figure agreeing with the samples and the other figures it comes from.
Memory itself is checked in process (tests/engine/test_memory.py)."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import soak

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
IDLE = {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}
CLIENTS = 4
SERVER_ARGS = ["--kv-cache-gb", "0.0625"]  # a start zeroes its whole cache
ROLES = {"api", "engine core"}  # the API process and the engine core it spawned
PER_KIND = ["sampled", "abandoned"]


def run(tmp_path: Path, *args: str) -> dict:
    result_file = tmp_path / "soak.json"
    command = [sys.executable, "-m", "benchmarks.soak", *args, "--clients", str(CLIENTS)]
    command += ["--sample-s", "0.2", "--result-file", str(result_file), "--plot-dir", str(tmp_path)]
    command += ["--server-args", *SERVER_ARGS]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(result_file.read_text())


def check_common(result: dict, phases: list[str]) -> None:
    """What both shapes report: the server, its RSS samples in `phases` order (then, maybe,
    idle), and no load left."""
    assert result["benchmark"] == "soak" and result["clients"] == CLIENTS
    assert result["server"].endswith(" ".join(SERVER_ARGS)) and result["fill"] is None
    assert result["after_load"] == IDLE
    samples = result["rss_samples"]
    # The first sample is the one taken at the start, reported as such.
    assert samples[0]["phase"] == "start" and samples[0]["mb"] == result["rss_at_start_mb"]
    assert set(result["rss_at_start_mb"]) == ROLES
    times = [s["t"] for s in samples]
    assert times == sorted(times)
    seen = [phase for phase, _ in itertools.groupby(s["phase"] for s in samples)]
    assert seen in (["start", *phases], ["start", *phases, "idle"]), seen
    assert all(set(s["mb"]) <= ROLES and min(s["mb"].values()) > 0 for s in samples)


def check_served(served: dict, kinds: list[str]) -> None:
    """Outcomes by kind, and their sums."""
    assert set(served["by_kind"]) <= set(kinds)
    total: dict[str, int] = {}
    for counts in served["by_kind"].values():
        for outcome, count in counts.items():
            total[outcome] = total.get(outcome, 0) + count
    assert served["outcomes"] == total
    assert served["requests"] == sum(total.values())


def check_growth(rss: dict, samples: list[dict], before: str, after: str, requests=None) -> None:
    """Each process's RSS before and after a phase, as sampled in it, and its growth."""
    assert set(rss) == ROLES
    for role, grown in rss.items():
        assert grown["before_mb"] in [s["mb"][role] for s in samples if s["phase"] == before]
        assert grown["after_mb"] in [s["mb"][role] for s in samples if s["phase"] == after]
        # Rounded apart: after and before to 0.1 MB, the growth to 0.01 MB.
        assert grown["growth_mb"] == pytest.approx(grown["after_mb"] - grown["before_mb"], abs=0.11)
        pct = 100 * grown["growth_mb"] / grown["before_mb"]
        assert grown["growth_pct"] == pytest.approx(pct, abs=0.02), role
        if requests is None:
            assert "growth_kb_per_request" not in grown
        else:
            grown_mb = grown["growth_kb_per_request"] * requests / 1024
            assert grown["growth_mb"] == pytest.approx(grown_mb, abs=0.006), role


def test_a_mixed_soak_serves_every_kind_and_ends_idle(tmp_path):
    result = run(tmp_path, "--duration", "4", "--warmup-s", "1")
    check_mixed(result)
    assert (tmp_path / "soak_mixed.png").stat().st_size > 0


def check_mixed(result: dict) -> None:
    check_common(result, ["warm-up", "load"])
    mixed = result["mixed"]
    load = mixed["load"]
    assert load["outcomes"] == {"ok": load["requests"]}, load
    assert mixed["warmup"]["outcomes"] == {"ok": mixed["warmup"]["requests"]}
    check_served(load, list(soak.KINDS))
    check_served(mixed["warmup"], list(soak.KINDS))
    assert len(load["by_kind"]) >= 6  # drawn at random: most kinds within a few seconds
    # The clients stop sending at the end of the duration, then finish what they sent.
    assert 4 <= load["wall_s"] < 4 + soak.REQUEST_TIMEOUT_S
    check_growth(mixed["rss"], result["rss_samples"], "warm-up", "load")


def test_a_per_kind_soak_reports_growth_per_request(tmp_path):
    result = run(tmp_path, "--per-kind", "6", "--warmup-requests", "2", "--kinds", *PER_KIND)
    check_per_kind(result)


def check_per_kind(result: dict) -> None:
    check_common(result, [phase for kind in PER_KIND for phase in (f"{kind} warm-up", kind)])
    assert list(result["per_kind"]) == PER_KIND
    for kind in PER_KIND:
        measured = result["per_kind"][kind]
        assert measured["requests"] == 6 and measured["outcomes"] == {"ok": 6}
        assert measured["by_kind"] == {kind: {"ok": 6}}
        assert measured["wall_s"] >= 0
        check_growth(measured["rss"], result["rss_samples"], f"{kind} warm-up", kind, 6)
