"""benchmarks/speculative_decoding.py end to end (--smoke): every batch size measured both
ways, the same tokens both ways, and every rate and ratio what its own counts and times
give; speeds never asserted."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_speculative_decoding_smoke(tmp_path):
    path = tmp_path / "s.json"
    command = [sys.executable, "benchmarks/speculative_decoding.py", "--smoke",
               "--result-file", str(path)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(path.read_text())
    assert result["benchmark"] == "speculative_decoding" and result["settings"]["smoke"]
    max_tokens = result["settings"]["max_tokens"]
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["same_tokens"] == row["batch"]
        assert row["output_tokens"] == row["batch"] * max_tokens
        for name in ("plain", "speculative"):
            wall = statistics.median(row["wall_s_runs"][name])
            assert row["output_tokens_per_s"][name] == pytest.approx(row["output_tokens"] / wall)
        per_s = row["output_tokens_per_s"]
        assert row["speedup"] == pytest.approx(per_s["speculative"] / per_s["plain"])
        assert 0 <= row["accepted_tokens"] <= row["draft_tokens"]
        if row["draft_tokens"]:
            assert row["acceptance"] == pytest.approx(row["accepted_tokens"] / row["draft_tokens"])
        # Without speculation a step gains one token per running request at most.
        assert row["tokens_per_step"]["plain"] <= row["batch"]
