"""benchmarks/step_latency.py runs end to end (--smoke: a 2-layer model on the CPU), so a GPU
session spends its minutes measuring. No speed is checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_step_latency_smoke_writes_its_result(tmp_path):
    result_file = tmp_path / "step_latency.json"
    command = [sys.executable, "benchmarks/step_latency.py", "--smoke", "--device", "cpu",
               "--result-file", str(result_file)]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(result_file.read_text())
    assert [(r["mode"], r["batch"]) for r in result["rows"]] == [("eager", 1), ("eager", 2)]
    for row in result["rows"]:
        # One token per sequence per decode step: the rates follow from the step time.
        step_s = row["step_ms_median"] / 1e3
        assert row["output_tokens_per_s"] == pytest.approx(row["batch"] / step_s)
        assert row["speedup_vs_hf"] == pytest.approx(row["hf_ms_per_token"] / row["step_ms_median"])
        assert row["step_ms_p90"] >= row["step_ms_median"] > 0
    assert result["goals"] == {"batch1_graph_step_ms": None, "batch1_under_1ms": False}
