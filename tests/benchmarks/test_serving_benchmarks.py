"""The serving benchmarks run end to end on a tiny workload: every request completes, every
token is counted and the JSON carries what the README's tables read. Speeds never are
checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--layers", "1", "--hidden", "16", "--heads", "1"]


def short_commit() -> str | None:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)  # fmt: skip
    return done.stdout.strip() if done.returncode == 0 else None


def run(script: str, result_file: Path, *args: str) -> dict:
    # The result file first: a script's --server-args takes the rest of the line.
    command = [sys.executable, f"benchmarks/{script}", "--result-file", str(result_file), *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(result_file.read_text())


def test_serving_throughput_serves_every_token_offline_and_in_every_mode(tmp_path):
    result = run(
        "serving_throughput.py", tmp_path / "s.json", *TINY,
        "--num-requests", "6", "--prompt-len", "4-8", "--output-len", "5-9", "--repeats", "1",
        "--modes", "streamed", "inprocess", "unstreamed", "interval8",
        "--py-spy-dir", str(tmp_path / "stacks"),
        "--server-args", "--kv-cache-gb", "0.0625",  # each start zeroes its whole cache
    )  # fmt: skip
    # The engine core's busy loop, sampled in its own process (and in the API process's
    # thread with --inprocess-engine) while the first timed run served.
    for mode in ("streamed", "inprocess"):
        assert "run_busy_loop" in (tmp_path / "stacks" / f"{mode}.txt").read_text(), mode
    tokens = result["offline"]["completion_tokens"]
    assert 6 * 5 <= tokens <= 6 * 9  # each request's length drawn from 5-9
    assert set(result["served"]) == {"streamed", "inprocess", "unstreamed", "interval8"}
    offline = result["offline"]
    assert offline["tokens_per_s"] == pytest.approx(tokens / offline["wall_s"])
    # One offline run before each served run (4 modes, 1 timed run each).
    assert len(offline["all_tokens_per_s"]) == 4
    # Host work: the wall time less the model's, so above 0 and below the whole.
    assert 0 < offline["host_us_per_token"] < offline["wall_s"] / tokens * 1e6
    assert offline["host_us_per_token"] in offline["all_host_us_per_token"]
    for mode, served in result["served"].items():
        assert served["failed"] == 0 and served["completion_tokens"] == tokens, mode
        assert served["tokens_per_s"] == pytest.approx(tokens / served["wall_s"]), mode
        # Each served run against the offline run just before it (one timed run each here).
        assert offline["tokens_per_s"] in offline["all_tokens_per_s"]
        assert served["all_kept_of_offline"] == [served["kept_of_offline"]], mode
        paired = served["paired_offline_tokens_per_s"]
        assert paired in offline["all_tokens_per_s"], mode
        assert served["kept_of_offline"] == pytest.approx(served["tokens_per_s"] / paired)
        # The API process, and the engine core process it started (inprocess: none).
        cpu = served["cpu_us_per_token"]
        assert "main" in cpu and min(cpu.values()) >= 0
        assert (mode != "inprocess") == any(name.startswith("child") for name in cpu), mode
    # Engine steps (from the engine, or the server's /metrics): the longest request needs one
    # per token (at least 5), and every step generates a token for some request.
    for name, measured in [("offline", offline), *result["served"].items()]:
        assert 5 <= measured["engine_steps"] <= tokens, name
        assert measured["tokens_per_step"] == pytest.approx(tokens / measured["engine_steps"])
    assert result["commit"] == short_commit()
    assert result["served"]["unstreamed"]["events"] == 0
    # Per stream at interval 8: the first token, the rest (at most 8), usage and [DONE].
    assert 3 * 6 <= result["served"]["interval8"]["events"] <= 4 * 6


def test_api_throughput_streams_every_token_of_the_stand_in_core(tmp_path):
    result = run(
        "api_throughput.py", tmp_path / "a.json",
        "--concurrency", "3", "--prompt-len", "4", "--output-len", "20",
    )  # fmt: skip
    (only,) = result["runs"]
    assert only["failed"] == 0 and only["completion_tokens"] == 60
    assert only["api_cpu_us_per_token"] == pytest.approx(only["api_cpu_s"] / 60 * 1e6)
    assert only["api_cpu_us_per_request"] == pytest.approx(only["api_cpu_s"] / 3 * 1e6)
    # Events that carry tokens: each stream's usage event and [DONE] carry none.
    assert only["tokens_per_event"] == pytest.approx(60 / (only["events"] - 2 * 3))
    assert only["tokens_per_s"] == pytest.approx(60 / only["wall_s"])
    assert 0 < only["ttft_median_s"] <= only["ttft_max_s"] < only["wall_s"]
    assert result["commit"] == short_commit()


def test_api_throughput_answers_plain_responses_unstreamed(tmp_path):
    result = run(
        "api_throughput.py", tmp_path / "a.json",
        "--concurrency", "3", "--prompt-len", "4", "--output-len", "2", "--unstreamed",
    )  # fmt: skip
    (only,) = result["runs"]
    assert only["failed"] == 0 and only["completion_tokens"] == 6
    assert only["events"] == 0 and only["tokens_per_event"] is None
    assert result["workload"]["streamed"] is False


def test_ray_serve_benchmark_serves_every_token_and_counts_prefix_hits(tmp_path):
    result = run("ray_serve.py", tmp_path / "r.json", "--smoke")
    (alone,) = result["throughput"].values()
    # --smoke: 4 requests x 4 tokens, and 2 fast streams x 8 tokens
    for workload, tokens in (("many streams", 16), ("few fast streams", 16)):
        runs = alone[workload]["runs"]
        assert alone[workload]["failed"] == 0
        assert all(r["completion_tokens"] == tokens for r in runs)
    prefix = result["routing"]["2 replicas"]["prefix"]
    # Two groups of two sharing a 64-token prefix (four 16-token blocks): routed by it, each
    # group's second request finds all of it cached.
    assert prefix["failed"] == 0 and prefix["cached_prompt_tokens"] == 2 * 64


def test_burst_floor_times_every_request_of_every_burst(tmp_path):
    result = run(
        "burst_floor.py", tmp_path / "b.json", "--num-requests", "5", "--repeats", "2",
        "--client-procs", "2",
    )  # fmt: skip
    assert result["workload"]["num_requests"] == 5 and len(result["runs"]) == 2
    for one in result["runs"]:
        # Every request arrived (or the script fails), after the first send and before the
        # client had its response.
        assert 0 < one["first_arrival_ms"] <= one["last_arrival_ms"] < one["client_wall_ms"]
        assert one["client_cpu_ms"] > 0
    assert result["commit"] == short_commit()


def test_startup_times_each_start_to_ready_and_to_a_completion(tmp_path):
    result = run("startup.py", tmp_path / "t.json", "--runs", "1")
    ((name, now),) = result["checkouts"].items()
    assert name == f"now@{short_commit()}"
    (only,) = now["runs"]
    # The completion is answered by the server that was ready: it comes after.
    assert 0 < only["ready_s"] < only["first_completion_s"]
    assert now["median_ready_s"] == only["ready_s"]
