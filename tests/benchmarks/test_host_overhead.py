"""benchmarks/host_overhead.py end to end at a tiny size, against a baseline that differs by a
known amount: --before-root is this checkout's package behind a sitecustomize that makes
every `schedule()` SLEEP_S slower, so the before/after comparison must show that difference
in the schedule phase and nowhere it would be misattributed. No speed of the engine is
checked; what the script computes from its own timings is."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BATCHES = (2, 4)
OUTPUT_LEN = 6
SLEEP_S = 0.1
PHASES = {"schedule", "execute", "forward", "sample", "update", "outputs"}

SLOWER_SCHEDULER = f"""
import time

from octavo.engine.core.engine_core import EngineCore

_init = EngineCore.__init__


def _init_with_a_slow_scheduler(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    schedule = self.scheduler.schedule

    def slow_schedule(*a, **k):
        time.sleep({SLEEP_S})
        return schedule(*a, **k)

    self.scheduler.schedule = slow_schedule


EngineCore.__init__ = _init_with_a_slow_scheduler
"""


def slower_checkout(folder: Path) -> Path:
    """A checkout root whose `octavo` and `benchmarks` are this one's, with every schedule()
    SLEEP_S slower."""
    folder.mkdir()
    (folder / "octavo").symlink_to(ROOT / "octavo")
    (folder / "benchmarks").symlink_to(ROOT / "benchmarks")
    (folder / "sitecustomize.py").write_text(textwrap.dedent(SLOWER_SCHEDULER))
    return folder


def short_commit(root: Path) -> str | None:
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)  # fmt: skip
    return done.stdout.strip() if done.returncode == 0 else None


def test_host_overhead_measures_a_different_baseline_and_attributes_it(tmp_path):
    result_file = tmp_path / "host_overhead.json"
    before = slower_checkout(tmp_path / "before")
    command = [sys.executable, "-m", "benchmarks.host_overhead",
               "--batch-sizes", *map(str, BATCHES), "--output-len", str(OUTPUT_LEN),
               "--prompt-len", "3-9",
               "--repeats", "1", "--before-root", str(before), "--rounds", "2",
               "--result-file", str(result_file)]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(result_file.read_text())
    assert result["machine"]["cpu_count"] == os.cpu_count() and result["machine"]["cpu_model"]
    assert result["workload"]["output_len"] == OUTPUT_LEN and result["workload"]["repeats"] == 1
    assert result["workload"]["prompt_len"] == [3, 9] and result["workload"]["rounds"] == 2
    ours_name, before_name = f"octavo@{short_commit(ROOT)}", f"before@{short_commit(before)}"
    assert list(result["systems"]) == [ours_name, before_name]
    for batches in result["systems"].values():
        assert set(batches) == {str(b) for b in BATCHES}
        for batch, row in batches.items():
            size = int(batch)
            # Greedy, EOS ignored, the whole batch prefilled in one step: each of the
            # OUTPUT_LEN steps gives every request one token.
            assert row["steady_steps"] == OUTPUT_LEN
            assert set(row["phases_ms"]) == PHASES
            step_s = row["step_ms"] / 1e3
            assert row["tokens_per_s"] == pytest.approx(size / step_s)
            assert row["host_us_per_token"] == pytest.approx(
                (row["step_ms"] - row["forward_ms"]) / size * 1e3
            )
            assert row["phases_ms"]["forward"] == pytest.approx(row["forward_ms"])
    for batch in map(str, BATCHES):
        slow = result["systems"][before_name][batch]
        fast = result["systems"][ours_name][batch]
        assert slow["phases_ms"]["schedule"] >= SLEEP_S * 1e3
        assert slow["step_ms"] >= SLEEP_S * 1e3
        # The sleep is the schedule phase's, and the baseline's only: not counted as the
        # output work around it, nor in this checkout (whose schedule takes microseconds).
        assert slow["phases_ms"]["outputs"] < SLEEP_S * 1e3 / 2
        assert fast["phases_ms"]["schedule"] < SLEEP_S * 1e3 / 2
