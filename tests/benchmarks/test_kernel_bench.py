"""benchmarks/kernel_bench.py runs end to end (--smoke: tiny shapes, the interpreter on CPU),
so a GPU session spends its minutes measuring, not debugging the script. No speed is checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_kernel_bench_smoke_writes_its_result(tmp_path):
    result_file = tmp_path / "kernel_bench.json"
    command = [
        sys.executable,
        "benchmarks/kernel_bench.py",
        "--smoke",
        "--sweep",
        "--result-file",
        str(result_file),
    ]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(result_file.read_text())
    assert result["settings"]["smoke"] is True
    assert [(r["batch"], r["context"]) for r in result["decode"]] == [(1, 24), (2, 24)]
    assert len(result["prefill"]) == 1
    for row in result["decode"] + result["prefill"]:
        assert row["ours_ms"] > 0 and row["sdpa_ms"] > 0
    # Rates follow from the times: both kernels of a row move the same bytes (decode) and
    # do the same FLOPs (prefill), and the fractions are of the reported references.
    for row in result["decode"]:
        speed = row["sdpa_ms"] / row["ours_ms"]
        assert row["ours_gbps"] / row["sdpa_gbps"] == pytest.approx(speed, rel=1e-9)
        fraction = row["ours_gbps"] / result["copy_bandwidth_gbps"]
        assert row["fraction_of_copy_bw"] == pytest.approx(fraction, rel=1e-9)
    for row in result["prefill"]:
        speed = row["sdpa_ms"] / row["ours_ms"]
        assert row["ours_tflops"] / row["sdpa_tflops"] == pytest.approx(speed, rel=1e-9)
        assert row["fraction_of_sdpa"] == pytest.approx(speed, rel=1e-9)
    sweep = result["sweep"]
    assert len(sweep["decode"]) == len(sweep["prefill"]) == 2
    assert all(r["ms"] > 0 and "error" not in r for r in sweep["decode"] + sweep["prefill"])
    assert set(result["goals"]) == {
        "decode_min_fraction_of_copy_bw", "decode_goal_met",
        "prefill_min_fraction_of_sdpa", "prefill_goal_met",
    }  # fmt: skip
