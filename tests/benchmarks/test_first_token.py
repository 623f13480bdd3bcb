"""The first-token benchmark runs on a tiny model: every timed stream gets all its tokens,
the served TTFT is split into parts that add up to it, and the engine's own figures come
with it; the stack summarizer reads py-spy's folded format; the contention probe reports a
row per load."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.stacks import DEFAULT_PHASES, per_step_ms, under_root

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


FIRST_TOKEN_ARGS = {"--layers": 1, "--hidden": 32, "--heads": 2, "--num-requests": 3,
                    "--warmup": 1, "--output-len": 5}  # fmt: skip


@pytest.mark.slow
def test_first_token_parts_add_up_to_the_served_ttft(tmp_path):
    result_file = tmp_path / "first_token.json"
    command = [sys.executable, "-m", "benchmarks.first_token",
               *(str(x) for item in FIRST_TOKEN_ARGS.items() for x in item),
               "--result-file", str(result_file),
               "--server-args", "--kv-cache-gb", "0.0625"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    check_first_token(json.loads(result_file.read_text()))


def check_first_token(result: dict) -> None:
    settings = result["settings"]
    for flag, value in FIRST_TOKEN_ARGS.items():
        assert settings[flag.removeprefix("--").replace("-", "_")] == value, flag
    assert settings["server_args"] == ["--kv-cache-gb", "0.0625"]
    served, engine = result["served"], result["engine"]
    assert served["command"].endswith(" --device cpu --dtype auto --kv-cache-gb 0.0625")
    # A token whose text is an incomplete character waits for the next: at most 5 events.
    events = served["events_per_request"]
    assert 1 <= events <= 5
    assert served["ttft_ms"]["count"] == engine["ttft_ms"]["count"] == 3
    assert served["itl_ms"]["count"] == round(3 * (events - 1))
    assert engine["itl_ms"]["count"] == 3 * 4  # the engine returns every token
    for source, name in itertools.product((served, engine), ("ttft_ms", "itl_ms")):
        summary = source[name]
        assert set(summary) == {"median", "mean", "p90", "count"}, name
        assert 0 < summary["median"] <= summary["p90"], name
        # Positive times: none above their sum, so the mean is at least 1/count of each.
        assert summary["p90"] <= summary["mean"] * summary["count"], name
        if summary["count"] == 3:  # the p90 of three is the middle one, their median
            assert summary["p90"] == summary["median"], name
    parts = served["parts_mean_ms"]
    # The client's mean TTFT is the timed streams' mean, split into its parts.
    assert parts["client_ttft"] == pytest.approx(served["ttft_ms"]["mean"], rel=1e-9)
    total = parts["outside"] + parts["queue"] + parts["step"]
    assert total == pytest.approx(parts["client_ttft"])
    # The server's span of a request lies inside the client's.
    assert parts["outside"] > 0 and parts["queue"] > 0 and parts["step"] > 0


def test_stacks_are_counted_per_step_under_the_root(tmp_path):
    stacks = tmp_path / "stacks.txt"
    stacks.write_text(
        'process 1:"octavo serve";run_busy_loop (a.py:1);Scheduler.schedule (s.py:2) 30\n'
        'process 1:"octavo serve";run_busy_loop (a.py:1);Scheduler.update (s.py:9) 10\n'
        'process 2:"api";Runner.run (r.py:1) 500\n'
    )
    ms = per_step_ms(under_root(stacks, "run_busy_loop"), DEFAULT_PHASES, rate=200, steps=10)
    assert ms["total under the root"] == pytest.approx(40 / 200 / 10 * 1e3)
    assert ms["schedule"] == pytest.approx(30 / 200 / 10 * 1e3)
    assert ms["apply results (update)"] == pytest.approx(10 / 200 / 10 * 1e3)
    assert ms["route and send outputs"] == 0


def test_the_contention_probe_reports_each_load(tmp_path):
    result_file = tmp_path / "contention.json"
    command = [sys.executable, "-m", "benchmarks.cpu_contention", "--busy", "0", "1",
               "--repeats", "2", "--items", "1000", "--result-file", str(result_file)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    check_contention(json.loads(result_file.read_text()))


def check_contention(result: dict) -> None:
    assert result["settings"] == {"items": 1000, "repeats": 2}
    rows = result["rows"]
    assert [row["busy_processes"] for row in rows] == [0, 1]
    alone = rows[0]["median_ms"]
    assert alone > 0 and rows[1]["median_ms"] > 0
    for row in rows:  # each load's time over the first's
        assert row["ratio_to_first"] == pytest.approx(row["median_ms"] / alone, rel=1e-9)
