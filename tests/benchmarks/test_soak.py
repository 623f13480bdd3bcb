"""The soak benchmark runs briefly in both shapes: every request it sends succeeds, the
server ends idle with every KV block free, and the JSON carries the memory the README's
table reads. Memory itself is checked in process (tests/engine/test_memory.py)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IDLE = {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}


def run(tmp_path: Path, *args: str) -> dict:
    result_file = tmp_path / "soak.json"
    command = [sys.executable, "benchmarks/soak.py", *args, "--clients", "4", "--sample-s", "0.2"]
    command += ["--result-file", str(result_file), "--plot-dir", str(tmp_path)]
    command += ["--server-args", "--kv-cache-gb", "0.0625"]  # a start zeroes its whole cache
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(result_file.read_text())


def test_a_mixed_soak_serves_every_kind_and_ends_idle(tmp_path):
    result = run(tmp_path, "--duration", "4", "--warmup-s", "1")
    load = result["mixed"]["load"]
    assert load["outcomes"] == {"ok": load["requests"]}, load
    assert len(load["by_kind"]) >= 6  # drawn at random: most kinds within a few seconds
    assert result["after_load"] == IDLE
    # The API process and the engine core it spawned, before and after the load.
    assert set(result["mixed"]["rss"]) == {"api", "engine core"}
    assert {"warm-up", "load"} <= {s["phase"] for s in result["rss_samples"]}
    assert (tmp_path / "soak_mixed.png").stat().st_size > 0


def test_a_per_kind_soak_reports_growth_per_request(tmp_path):
    kinds = ["sampled", "abandoned"]
    result = run(tmp_path, "--per-kind", "6", "--warmup-requests", "2", "--kinds", *kinds)
    for kind in kinds:
        measured = result["per_kind"][kind]
        assert measured["outcomes"] == {"ok": 6}
        assert measured["by_kind"] == {kind: {"ok": 6}}
        core = measured["rss"]["engine core"]
        grown_kb = (core["after_mb"] - core["before_mb"]) * 1024 / 6
        assert abs(core["growth_kb_per_request"] - grown_kb) < 0.1 * 1024 / 6 + 1e-6
    assert result["after_load"] == IDLE
