"""`octavo bench serve` (octavo/bench/load_test.py) against live servers."""

import json
import subprocess
import sys

import pytest

from tests.server.conftest import live_server

pytestmark = pytest.mark.slow


def bench(base_url: str, tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    result_file = tmp_path / "result.json"
    cmd = [
        sys.executable,
        "-m",
        "octavo",
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--result-file",
        str(result_file),
        "--no-progress",
        *flags,
    ]
    process = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return process, json.loads(result_file.read_text())


def test_load_test_completes_every_request_with_sane_metrics(server, tmp_path):
    process, report = bench(
        server.base_url,
        tmp_path,
        "--num-prompts",
        "120",
        "--random-input-len",
        "24",
        "--random-output-len",
        "8",
        "--random-range-ratio",
        "0.5",
        "--ignore-eos",
        "--max-concurrency",
        "32",
        "--goodput",
        "ttft:60000",
        "e2el:60000",
        "--plot-dir",
        str(tmp_path / "plots"),
    )
    assert process.returncode == 0, process.stderr
    summary = report["passes"][0]["summary"]
    per_request = report["passes"][0]["per_request"]
    assert summary["completed"] == 120 and summary["failed"] == 0
    assert per_request["output_tokens"] == per_request["output_len_requested"]
    assert summary["total_output_tokens"] == sum(per_request["output_len_requested"])
    for ttft, e2el in zip(per_request["ttft"], per_request["e2el"], strict=True):
        assert 0 < ttft <= e2el
    for metric in ("ttft", "tpot", "itl", "e2el"):
        stats = summary[metric]
        assert 0 < stats["median_ms"] <= stats["p90_ms"] <= stats["p99_ms"]
    assert summary["request_throughput"] > 0 and summary["goodput"] == summary["request_throughput"]
    assert {p.rsplit("/", 1)[1] for p in report["plots"]} == {
        "ttft_cdf.png",
        "tpot_cdf.png",
        "e2el_cdf.png",
    }
    assert "Output token throughput" in process.stdout


def test_a_sweep_writes_one_pass_per_rate_and_a_sweep_plot(server, tmp_path):
    process, report = bench(
        server.base_url,
        tmp_path,
        "--num-prompts",
        "12",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
        "--ignore-eos",
        "--sweep-rates",
        "20,inf",
        "--burstiness",
        "0.5",
        "--plot-dir",
        str(tmp_path / "plots"),
    )
    assert process.returncode == 0, process.stderr
    assert [p["request_rate"] for p in report["passes"]] == [20.0, "inf"]
    assert any(p.endswith("sweep.png") for p in report["plots"])


def test_503s_count_as_failures_with_their_reason_and_exit_non_zero(tiny_model_dir, tmp_path):
    with live_server(
        tiny_model_dir, tmp_path, "--max-num-seqs", "2", "--max-num-waiting", "3"
    ) as small:
        process, report = bench(
            small.base_url,
            tmp_path,
            "--num-prompts",
            "40",
            "--random-input-len",
            "16",
            "--random-output-len",
            "32",
            "--ignore-eos",
        )
    assert process.returncode == 1
    summary = report["passes"][0]["summary"]
    assert summary["failed"] > 0 and summary["completed"] + summary["failed"] == 40
    assert all(reason.startswith("HTTP 503") for reason in summary["failure_reasons"])
    assert "FAILED" in process.stdout and "failed" in process.stderr
    assert "Traceback" not in process.stderr
