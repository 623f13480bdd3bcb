"""benchmarks/structured_outputs.py runs end to end (--smoke) and its figures add up. No speed
is checked."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import structured_outputs
from octavo.server.server_args import DEFAULT_MODEL

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# What --smoke sets.
SMOKE = {"num_requests": 4, "output_len": 4, "repeats": 1, "ttft_repeats": 2}


def test_structured_outputs_smoke_writes_consistent_figures(tmp_path):
    result_file = tmp_path / "structured_outputs.json"
    command = [sys.executable, "-m", "benchmarks.structured_outputs", "--smoke",
               "--result-file", str(result_file)]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    check_result(json.loads(result_file.read_text()))


def check_result(result: dict) -> None:
    vocab = json.loads((DEFAULT_MODEL / "config.json").read_text())["vocab_size"]
    assert result["settings"] == {"vocab": vocab, **SMOKE, "xgrammar": False, "smoke": True}
    guidance = result["llguidance"]
    assert guidance["tokenizer_ms"] > 0
    # Every kind of constraint, each timed cold, cached and as a matcher.
    assert list(guidance["compile"]) == list(structured_outputs.CONSTRAINTS)
    for kind, row in guidance["compile"].items():
        assert set(row) == {"compile_cold_ms", "compile_cached_ms", "matcher_ms"}, kind
        assert all(ms > 0 for ms in row.values()), kind
    # One step's masks at each batch size, and per row: the step's time over the batch.
    assert list(guidance["mask"]) == [str(b) for b in structured_outputs.MASK_BATCHES]
    for batch, row in guidance["mask"].items():
        assert row["step_ms"] > 0
        assert row["per_row_us"] == pytest.approx(row["step_ms"] * 1e3 / int(batch), rel=1e-9)
    engine = result["engine"]
    assert list(engine) == ["none", "half", "all"]
    for mix, row in engine.items():
        # --smoke: one run of each mix, its median.
        assert len(row["runs"]) == SMOKE["repeats"] and min(row["runs"]) > 0, mix
        assert row["tokens_per_s"] == statistics.median(row["runs"]), mix
    assert "vs_none" not in engine["none"]
    for mix in ("half", "all"):
        assert engine[mix]["vs_none"] == pytest.approx(
            engine[mix]["tokens_per_s"] / engine["none"]["tokens_per_s"], rel=1e-9
        )
    ttft = result["ttft"]
    assert ttft["none_ms"] > 0 and ttft["cached_schema_ms"] > 0
    assert ttft["added_ms"] == pytest.approx(ttft["cached_schema_ms"] - ttft["none_ms"], rel=1e-9)
    assert result["xgrammar"] is None  # not asked for
