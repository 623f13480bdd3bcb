"""The fairness benchmark runs on a tiny model: each run serves its clients, the shares of the
tokens served add up, and the interactive client's TTFT is reported against its floor."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_fairness_reports_each_client_under_each_policy(tmp_path):
    result_file = tmp_path / "fairness.json"
    command = [sys.executable, "-m", "benchmarks.fairness", "--layers", "1", "--hidden", "32",
               "--heads", "2", "--vocab", "256", "--max-num-seqs", "4",
               "--flood-concurrency", "6", "--flood-prompt-len", "32", "--flood-output-len", "8",
               "--chat-prompt-len", "8", "--chat-output-len", "4", "--duration-s", "2",
               "--light-concurrency", "3", "--warmup-s", "0.5", "--kv-cache-gb", "0.0625",
               "--runs", "alone", "fair", "backlogged-fair",
               "--result-file", str(result_file)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(result_file.read_text())
    assert set(result["runs"]) == {"alone", "fair", "backlogged-fair"}
    runs = result["runs"]
    for name, clients in (("fair", ("chat", "flood")), ("backlogged-fair", ("heavy", "light"))):
        assert all(runs[name][c]["requests"] > 0 for c in clients)
        shares = sum(runs[name][c]["share_of_served_tokens"] for c in clients)
        assert abs(shares - 1) < 1e-9
    assert runs["fair"]["chat_ttft_over_alone"] > 0
    assert result_file.with_suffix(".png").stat().st_size > 0
