"""benchmarks/host_overhead.py runs end to end at a tiny size, here and against another
checkout (--before-root, this one), so a GPU session spends its minutes measuring. No speed
is checked."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_overhead_writes_every_phase_for_both_checkouts(tmp_path):
    result_file = tmp_path / "host_overhead.json"
    command = [sys.executable, "benchmarks/host_overhead.py", "--batch-sizes", "2", "4",
               "--output-len", "6", "--repeats", "1", "--before-root", str(ROOT),
               "--result-file", str(result_file)]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    systems = json.loads(result_file.read_text())["systems"]
    assert len(systems) == 2
    for batches in systems.values():
        assert set(batches) == {"2", "4"}
        for row in batches.values():
            assert row["steady_steps"] > 0 and row["tokens_per_s"] > 0
            assert set(row["phases_ms"]) == {
                "schedule",
                "execute",
                "forward",
                "sample",
                "update",
                "outputs",
            }
