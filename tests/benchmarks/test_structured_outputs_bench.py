"""benchmarks/structured_outputs.py runs end to end (--smoke) and its figures add up. No speed
is checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_structured_outputs_smoke_writes_consistent_figures(tmp_path):
    result_file = tmp_path / "structured_outputs.json"
    command = [sys.executable, "benchmarks/structured_outputs.py", "--smoke",
               "--result-file", str(result_file)]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(result_file.read_text())
    guidance = result["llguidance"]
    assert set(guidance["compile"]) == {"json_schema", "regex", "choice", "grammar"}
    assert all(row["compile_cold_ms"] > 0 for row in guidance["compile"].values())
    for batch, row in guidance["mask"].items():
        assert row["per_row_us"] == pytest.approx(row["step_ms"] * 1e3 / int(batch))
    engine = result["engine"]
    for mix in ("half", "all"):
        assert engine[mix]["vs_none"] == pytest.approx(
            engine[mix]["tokens_per_s"] / engine["none"]["tokens_per_s"]
        )
    ttft = result["ttft"]
    assert ttft["added_ms"] == pytest.approx(ttft["cached_schema_ms"] - ttft["none_ms"])
    assert result["xgrammar"] is None  # not asked for
