"""A bounded, seeded schemathesis run over a live server's /openapi.json: whatever it sends,
the answer is a 200 or an OpenAI-shaped 4xx, never a 5xx, and afterwards every KV block is
free. The property-based fuzzing of every completion and chat field is in-process
(inprocess/test_fuzz.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.test_load_and_disconnect import wait_for_idle

pytestmark = pytest.mark.slow


def test_schemathesis_finds_nothing(server, tmp_path):
    """Every check but positive_data_acceptance: that one expects every schema-valid body to
    be accepted, while some are rightly a 400 that no JSON Schema can state (a prompt plus
    max_tokens longer than the context, min_tokens > max_tokens, best_of < n with beam
    search, token ids past the vocabulary)."""
    command = [
        str(Path(sys.executable).parent / "schemathesis"), "run",
        f"{server.base_url}/openapi.json",
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--max-examples", "60", "--seed", "0", "--workers", "1",
    ]  # fmt: skip
    # From a scratch folder: schemathesis keeps a cache in the working directory.
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    metrics = wait_for_idle(server, timeout=5.0)
    assert metrics["octavo:kv_cache_usage_perc"] == 0, metrics
