"""benchmarks/lora_bench.py end to end (--smoke): the three runs measured, every rate and ratio
what its own counts and times give; speeds never asserted."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_lora_bench_smoke(tmp_path):
    path = tmp_path / "l.json"
    command = [sys.executable, "-m", "benchmarks.lora_bench", "--smoke", "--result-file", str(path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(path.read_text())
    assert result["benchmark"] == "lora_bench" and result["settings"]["smoke"]
    settings = result["settings"]
    assert result["output_tokens"] == settings["batch"] * settings["max_tokens"]
    per_s = result["output_tokens_per_s"]
    assert set(per_s) == {"base", "lora_engine_base_requests", "mixed"}
    for name, walls in result["wall_s_runs"].items():
        assert len(walls) == settings["repeats"]
        assert per_s[name] == pytest.approx(result["output_tokens"] / statistics.median(walls))
    for name, ratio in result["ratio_to_base"].items():
        assert ratio == pytest.approx(per_s[name] / per_s["base"])
