"""benchmarks/profile_decode.py runs end to end (--smoke: a 2-layer model on the CPU), so a GPU
session spends its minutes profiling. No speed is checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_smoke(tmp_path, *flags: str) -> dict:
    result_file = tmp_path / "profile_decode.json"
    command = [sys.executable, "benchmarks/profile_decode.py", "--smoke",
               "--result-file", str(result_file), *flags]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(result_file.read_text())


def test_profile_decode_smoke_writes_its_result(tmp_path):
    result = run_smoke(tmp_path)
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["prompt_tokens_per_step"] == 0  # decode-only steps
        # Every sequence samples one token per timed step.
        assert row["generated_tokens_per_s"] == pytest.approx(
            row["batch"] / (row["step_ms_mean"] / 1e3)
        )
        assert row["step_ms_median"] > 0 and row["profiled_step_ms"] > 0
        assert row["output_tokens_per_s"] == pytest.approx(
            row["batch"] / (row["step_ms_median"] / 1e3)
        )
        # No CUDA device: no GPU-busy figure and no roofline, never a made-up one.
        assert row["gpu_busy_fraction"] is None and row["fraction_of_roofline"] is None
        assert row["bytes_per_step"] > 0
        phases = row["host_phases_ms_per_step"]
        assert phases["execute.sample"] > 0 and phases["schedule"] > 0 and phases["update"] > 0
        assert any(op["self_cpu_us"] > 0 for op in row["top_host_ops"])


def test_arrivals_make_every_timed_step_a_mixed_one(tmp_path):
    """--arrivals 1: one prompt of --arrival-prompt-len tokens admitted before each timed
    step, the batch kept at its size."""
    result = run_smoke(tmp_path, "--arrivals", "1", "--arrival-prompt-len", "5")
    assert result["settings"]["arrivals"] == 1
    assert result["settings"]["prefill_interval"] == 1  # the engine's default on a CPU
    for row in result["rows"]:
        assert row["prompt_tokens_per_step"] == 5
        assert row["step_ms_median"] > 0
