"""benchmarks/step_latency.py runs end to end (--smoke: a 2-layer model on the CPU), so a GPU
session spends its minutes measuring. No speed is checked; each figure agrees with the ones it
is computed from."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import step_latency

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_step_latency_smoke_writes_its_result(tmp_path):
    result_file = tmp_path / "step_latency.json"
    command = [sys.executable, "-m", "benchmarks.step_latency", "--smoke", "--device", "cpu",
               "--result-file", str(result_file)]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    check_result(json.loads(result_file.read_text()))


def check_result(result: dict) -> None:
    settings = result["settings"]
    assert settings["smoke"] is True and settings["preset"] == "smoke"
    assert settings["dtype"] == "float32"
    batches = list(step_latency.SMOKE_BATCHES)
    assert settings["batches"] == batches
    assert (settings["steps"], settings["warmup_steps"]) == (
        step_latency.SMOKE_STEPS,
        step_latency.SMOKE_WARMUP,
    )
    # On the CPU, eager steps only: each batch once.
    assert [(r["mode"], r["batch"]) for r in result["rows"]] == [("eager", b) for b in batches]
    # Three timed steps (the rest warm up): their p90 is the middle one, their median.
    assert settings["steps"] - settings["warmup_steps"] == 3
    for row in result["rows"]:
        # One token per sequence per decode step: the rates follow from the step time.
        step_s = row["step_ms_median"] / 1e3
        assert row["output_tokens_per_s"] == pytest.approx(row["batch"] / step_s, rel=1e-9)
        speedup = row["hf_ms_per_token"] / row["step_ms_median"]
        assert row["speedup_vs_hf"] == pytest.approx(speedup, rel=1e-9)
        assert row["hf_ms_per_token"] > 0
        assert row["step_ms_p90"] == row["step_ms_median"] > 0
    # The goal is CUDA graphs' batch 1: no such row here.
    assert result["goals"] == {"batch1_graph_step_ms": None, "batch1_under_1ms": False}
