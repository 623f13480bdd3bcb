"""The serving benchmarks run end to end on a tiny workload: every request completes, every
token is counted and the JSON carries what the README's tables read. Speeds never are
checked."""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks import serving_throughput

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--layers", "1", "--hidden", "16", "--heads", "1"]
MODES = ["streamed", "inprocess", "unstreamed", "interval8"]  # serving_throughput.py's


def short_commit() -> str | None:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)  # fmt: skip
    return done.stdout.strip() if done.returncode == 0 else None


def run(module: str, result_file: Path, *args: str) -> dict:
    # The result file first: a script's --server-args takes the rest of the line.
    command = [sys.executable, "-m", f"benchmarks.{module}", "--result-file", str(result_file)]
    command += args
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(result_file.read_text())


def test_serving_throughput_serves_every_token_offline_and_in_every_mode(tmp_path):
    result = run(
        "serving_throughput", tmp_path / "s.json", *TINY,
        "--num-requests", "6", "--prompt-len", "4-8", "--output-len", "5-9", "--repeats", "1",
        "--modes", *MODES, "--py-spy-dir", str(tmp_path / "stacks"),
        "--server-args", "--kv-cache-gb", "0.0625",  # each start zeroes its whole cache
    )  # fmt: skip
    # The engine core's busy loop, sampled in its own process (and in the API process's
    # thread with --inprocess-engine) while the first timed run served.
    for mode in ("streamed", "inprocess"):
        assert "run_busy_loop" in (tmp_path / "stacks" / f"{mode}.txt").read_text(), mode
    check_serving_throughput(result)


def check_clients(run: dict, tokens: int) -> None:
    """sse_client.run_clients' figures of one run that got every one of `tokens`."""
    assert run["failed"] == 0 and run["completion_tokens"] == tokens
    assert run["tokens_per_s"] == pytest.approx(tokens / run["wall_s"], rel=1e-9)
    share = run["client_cpu_s"] / run["wall_s"]
    assert run["client_cpu_share_of_a_core"] == pytest.approx(share, rel=1e-9)
    # Every response's first event (or whole response) came within the run.
    assert 0 < run["ttft_median_s"] <= run["ttft_max_s"] <= run["wall_s"]


def check_serving_throughput(result: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:  # the script's model: its vocabulary
        workload = argparse.Namespace(seed=0, num_requests=6, prompt_len=(4, 8),
                                      output_len=(5, 9), layers=1, hidden=16, heads=1)  # fmt: skip
        vocab = serving_throughput.write_model(Path(tmp), workload)
    assert result["workload"] == {
        "model": f"1x16 GPT-2, vocab {vocab}, dummy weights", "device": "cpu", "dtype": "auto",
        "preset": None, "num_requests": 6, "prompt_len": [4, 8], "output_len": [5, 9],
        "client_procs": 1, "prefill_interval": None, "piecewise_cuda_graphs": None,
    }  # fmt: skip
    # Each request's length drawn from 5-9: the requests' lengths summed, every run.
    requests = serving_throughput.make_requests(workload, vocab)
    tokens = sum(output_len for _, output_len in requests)
    offline = result["offline"]
    assert offline["completion_tokens"] == tokens
    assert offline["tokens_per_s"] == pytest.approx(tokens / offline["wall_s"], rel=1e-9)
    # One offline run before each served run (4 modes, 1 timed run each); the median kept.
    runs = offline["all_tokens_per_s"]
    assert len(runs) == 4 and offline["tokens_per_s"] == sorted(runs)[len(runs) // 2]
    # Host work: the wall time less the model's, so above 0 and below the whole, each run.
    assert 0 < offline["host_us_per_token"] < offline["wall_s"] / tokens * 1e6
    assert len(offline["all_host_us_per_token"]) == len(runs)
    for host_us, tokens_per_s in zip(offline["all_host_us_per_token"], runs, strict=True):
        assert 0 < host_us < 1e6 / tokens_per_s
    median_index = runs.index(offline["tokens_per_s"])
    assert offline["all_host_us_per_token"][median_index] == offline["host_us_per_token"]
    assert list(result["served"]) == MODES
    for mode, served in result["served"].items():
        check_clients(served, tokens)
        assert "timeline" not in served  # not asked for
        # Each served run against the offline run just before it (one timed run each here).
        assert served["all_tokens_per_s"] == [served["tokens_per_s"]], mode
        assert served["all_kept_of_offline"] == [served["kept_of_offline"]], mode
        paired = served["paired_offline_tokens_per_s"]
        kept = served["tokens_per_s"] / paired
        assert served["kept_of_offline"] == pytest.approx(kept, rel=1e-9), mode
        # The API process, and the engine core process it started (inprocess: none).
        cpu = served["cpu_us_per_token"]
        assert "main" in cpu and min(cpu.values()) >= 0
        assert (mode != "inprocess") == any(name.startswith("child") for name in cpu), mode
        command = served["command"]
        assert command.endswith("--kv-cache-gb 0.0625"), mode
        assert ("--inprocess-engine" in command) == (mode == "inprocess"), mode
        assert ("--stream-interval 8" in command) == (mode == "interval8"), mode
    # Every offline run was paired with one served run, each with its own.
    paired = sorted(served["paired_offline_tokens_per_s"] for served in result["served"].values())
    assert paired == sorted(runs)
    # Streamed and unstreamed share a server.
    assert result["served"]["streamed"]["command"] == result["served"]["unstreamed"]["command"]
    # Engine steps (from the engine, or the server's /metrics): the longest request needs one
    # per token (at least 5), and every step generates a token for some request.
    longest = max(output_len for _, output_len in requests)
    for name, measured in [("offline", offline), *result["served"].items()]:
        assert longest <= measured["engine_steps"] <= tokens, name
        tokens_per_step = tokens / measured["engine_steps"]
        assert measured["tokens_per_step"] == pytest.approx(tokens_per_step, rel=1e-9), name
    assert result["commit"] == short_commit()
    # Per stream: its first token, at most one event a token, usage and [DONE]; at interval
    # 8, the first token, the rest (at most 8) in one event, usage and [DONE].
    for mode in ("streamed", "inprocess"):
        assert 3 * 6 <= result["served"][mode]["events"] <= tokens + 2 * 6, mode
    assert result["served"]["unstreamed"]["events"] == 0
    assert 3 * 6 <= result["served"]["interval8"]["events"] <= 4 * 6


def test_api_throughput_streams_every_token_of_the_stand_in_core(tmp_path):
    result = run(
        "api_throughput", tmp_path / "a.json",
        "--concurrency", "3", "--prompt-len", "4", "--output-len", "20",
    )  # fmt: skip
    check_api_streamed(result)


def check_api_streamed(result: dict) -> None:
    assert result["workload"] == {
        "prompt_len": [4, 4], "output_len": [20, 20], "step_ms": 0.0, "streamed": True,
    }  # fmt: skip
    (only,) = result["runs"]
    assert only["concurrency"] == 3
    check_clients(only, 60)
    assert only["api_cpu_us_per_token"] == pytest.approx(only["api_cpu_s"] / 60 * 1e6)
    assert only["api_cpu_us_per_request"] == pytest.approx(only["api_cpu_s"] / 3 * 1e6)
    # Events that carry tokens: each stream's usage event and [DONE] carry none; at least
    # one carries its tokens, at most one a token.
    assert 3 * 3 <= only["events"] <= 60 + 2 * 3
    assert only["tokens_per_event"] == pytest.approx(60 / (only["events"] - 2 * 3))
    assert only["ttft_max_s"] < only["wall_s"]
    assert result["commit"] == short_commit()


def test_api_throughput_answers_plain_responses_unstreamed(tmp_path):
    result = run(
        "api_throughput", tmp_path / "a.json",
        "--concurrency", "3", "--prompt-len", "4", "--output-len", "2", "--unstreamed",
    )  # fmt: skip
    check_api_unstreamed(result)


def check_api_unstreamed(result: dict) -> None:
    assert result["workload"] == {
        "prompt_len": [4, 4], "output_len": [2, 2], "step_ms": 0.0, "streamed": False,
    }  # fmt: skip
    (only,) = result["runs"]
    assert only["concurrency"] == 3
    check_clients(only, 6)
    assert only["events"] == 0 and only["tokens_per_event"] is None
    assert only["api_cpu_us_per_token"] == pytest.approx(only["api_cpu_s"] / 6 * 1e6)
    assert only["api_cpu_us_per_request"] == pytest.approx(only["api_cpu_s"] / 3 * 1e6)


def test_ray_serve_benchmark_serves_every_token_and_counts_prefix_hits(tmp_path):
    check_ray_serve(run("ray_serve", tmp_path / "r.json", "--smoke"))


def check_ray_serve(result: dict) -> None:
    settings = result["settings"]
    # --smoke: 4 requests x 4 tokens, and 2 fast streams x 8 tokens, one timed run each.
    smoke = {"num_requests": 4, "output_len": 4, "repeats": 1, "fast_requests": 2,
             "fast_output_len": 8, "prefixes": 2, "per_prefix": 2, "prefix_len": 64,
             "routing_replicas": [2], "kv_cache_gb": 0.0625, "smoke": True}  # fmt: skip
    assert {key: settings[key] for key in smoke} == smoke
    (alone,) = result["throughput"].values()
    assert list(result["throughput"]) == ["octavo serve"]  # --smoke: no Ray throughput run
    assert list(alone) == ["many streams", "few fast streams"]
    for workload, tokens in (("many streams", 16), ("few fast streams", 16)):
        summary = alone[workload]
        runs = summary["runs"]
        assert len(runs) == 1
        for one in runs:
            check_clients(one, tokens)
        # The summary of the runs: medians, the failures summed, the busiest client.
        assert summary["tokens_per_s"] == statistics.median(r["tokens_per_s"] for r in runs)
        assert summary["ttft_median_s"] == statistics.median(r["ttft_median_s"] for r in runs)
        assert summary["failed"] == sum(r["failed"] for r in runs) == 0
        shares = [r["client_cpu_share_of_a_core"] for r in runs]
        assert summary["client_cpu_share_of_a_core"] == max(shares)
    assert list(result["routing"]) == ["2 replicas"]
    assert list(result["routing"]["2 replicas"]) == ["prefix"]  # --smoke: prefix routing only
    prefix = result["routing"]["2 replicas"]["prefix"]
    # Two groups of two sharing a 64-token prefix (four 16-token blocks): routed by it, each
    # group's second request finds all of it cached.
    assert prefix["failed"] == 0 and prefix["cached_prompt_tokens"] == 2 * 64
    # The second wave: one request a group, its prefix and its own 16 tokens.
    assert prefix["prompt_tokens"] == 2 * (64 + 16)
    assert prefix["hit_rate"] == pytest.approx(2 * 64 / prefix["prompt_tokens"], rel=1e-9)
    assert result["commit"] == short_commit()


def test_burst_floor_times_every_request_of_every_burst(tmp_path):
    result = run(
        "burst_floor", tmp_path / "b.json", "--num-requests", "5", "--repeats", "2",
        "--client-procs", "2",
    )  # fmt: skip
    check_burst_floor(result)


def check_burst_floor(result: dict) -> None:
    assert result["workload"] == {"preset": "gpu-speed", "num_requests": 5, "client_procs": 2}
    assert len(result["runs"]) == 2
    for one in result["runs"]:
        # Every request arrived (or the script fails), after the first send and before the
        # client had its response.
        assert 0 < one["first_arrival_ms"] <= one["last_arrival_ms"] < one["client_wall_ms"]
        assert one["client_cpu_ms"] > 0
    assert result["commit"] == short_commit()


def test_startup_times_each_start_to_ready_and_to_a_completion(tmp_path):
    check_startup(run("startup", tmp_path / "t.json", "--runs", "1"))


def check_startup(result: dict) -> None:
    assert result["workload"]["device"] == "cpu"
    assert result["workload"]["model"].startswith("dummy ")  # no --model: the dummy 2x64
    ((name, now),) = result["checkouts"].items()
    assert name == f"now@{short_commit()}"
    (only,) = now["runs"]
    # The completion is answered by the server that was ready: it comes after.
    assert 0 < only["ready_s"] < only["first_completion_s"]
    # One run: the medians are its own figures.
    assert now["median_ready_s"] == only["ready_s"]
    assert now["median_first_completion_s"] == only["first_completion_s"]
