"""benchmarks/speculative_decoding.py end to end (--smoke): every batch size measured plain,
with n-gram and with a draft model, the same tokens every way, and every rate and ratio what
its own counts and times give; speeds never asserted."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_speculative_decoding_smoke(tmp_path):
    path = tmp_path / "s.json"
    # float32: the tokens must then be plain's exactly, whatever the batch shapes.
    command = [sys.executable, "-m", "benchmarks.speculative_decoding", "--smoke",
               "--dtype", "float32", "--result-file", str(path)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(path.read_text())
    assert result["benchmark"] == "speculative_decoding" and result["settings"]["smoke"]
    max_tokens = result["settings"]["max_tokens"]
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    speculating = ("ngram", "draft_model")
    assert set(result["settings"]["speculative_config"]) == set(speculating)
    for row in result["rows"]:
        batch = row["batch"]
        assert row["output_tokens"] == batch * max_tokens
        per_s = row["output_tokens_per_s"]
        for name in ("plain", *speculating):
            wall = statistics.median(row["wall_s_runs"][name])
            assert per_s[name] == pytest.approx(row["output_tokens"] / wall)
        # Without speculation a step gains one token per running request at most.
        assert row["tokens_per_step"]["plain"] <= batch
        assert row["draft_tokens"]["plain"] == 0
        assert row["plain_first_run_same_tokens"] == batch
        for name in speculating:
            assert row["same_tokens"][name] == batch
            assert row["speedup"][name] == pytest.approx(per_s[name] / per_s["plain"])
            drafted, accepted = row["draft_tokens"][name], row["accepted_tokens"][name]
            assert 0 <= accepted <= drafted
            assert row["acceptance"][name] == (
                pytest.approx(accepted / drafted) if drafted else None
            )
        # The draft model proposes for every decode (a prompt lookup may find nothing).
        assert row["draft_tokens"]["draft_model"] > 0
