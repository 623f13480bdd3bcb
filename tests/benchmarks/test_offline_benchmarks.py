"""The offline benchmarks run end to end on a tiny model (Octavo and its HF peers), so a GPU
session spends its minutes measuring. Correctness fields are checked, and every rate and ratio
against the counts and times the same result reports; speeds never are."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# A tiny model, and a KV cache to match: each engine zeroes its whole cache when it starts.
TINY = ["--layers", "1", "--hidden", "64", "--heads", "2", "--vocab", "512",
        "--kv-cache-gb", "0.0625"]  # fmt: skip


def run(module: str, result_file: Path, *args: str) -> dict:
    command = [
        sys.executable,
        "-m",
        f"benchmarks.{module}",
        *TINY,
        *args,
        "--result-file",
        str(result_file),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(result_file.read_text())
    machine = result["machine"]
    assert machine["cpu_count"] == os.cpu_count() and machine["torch"] == torch.__version__
    return result


def test_offline_throughput_against_both_hf_peers(tmp_path):
    result = run(
        "offline_throughput", tmp_path / "o.json",
        "--num-requests", "4", "--prompt-len", "4", "8", "--output-len", "2", "4", "--repeats", "1",
    )  # fmt: skip
    systems, workload = result["systems"], result["workload"]
    assert set(systems) == {"octavo", "hf_static", "hf_cb"}
    # Four requests of 2-4 output tokens each, EOS ignored: every system makes them all.
    assert 4 * 2 <= workload["output_tokens"] <= 4 * 4
    for name, system in systems.items():
        assert system["error"] is None, name
        assert system["useful_output_tokens"] == workload["output_tokens"], name
        assert system["wall_s"] == statistics.median(system["wall_s_runs"])
        assert len(system["wall_s_runs"]) == workload["timed_repeats"] == 1
        assert system["useful_output_tokens_per_s"] == pytest.approx(
            system["useful_output_tokens"] / system["wall_s"]
        )
    # Without padding, each prompt and output token is processed once.
    exact = workload["prompt_tokens"] + workload["output_tokens"]
    assert systems["octavo"]["total_tokens_processed"] == exact
    assert systems["hf_static"]["total_tokens_processed"] >= exact
    for peer in ("hf_static", "hf_cb"):
        assert result["ratios"][f"octavo/{peer}"] == pytest.approx(
            systems["octavo"]["useful_output_tokens_per_s"]
            / systems[peer]["useful_output_tokens_per_s"]
        )
    for key in ("greedy_match", "greedy_match_hf_cb"):
        assert result[key]["matched"] == result[key]["compared"] == 4


def test_beam_bench_against_hf(tmp_path):
    result = run(
        "beam_bench", tmp_path / "b.json",
        "--widths", "2", "--prompt-lens", "8", "--num-requests", "2", "--max-tokens", "4",
        "--noisy-retries", "0",
    )  # fmt: skip
    (config,) = result["results"].values()
    assert config["best_beam_match"]["matched"] == config["best_beam_match"]["compared"] == 2
    ours, hf = config["octavo"], config["hf"]
    for system in (ours, hf):
        assert system["error"] is None
        # Two requests of 4 tokens (EOS ignored), two beams each.
        assert system["output_tokens_per_s"] == pytest.approx(2 * 4 / system["wall_s"])
        assert system["beam_tokens_per_s"] == pytest.approx(2 * system["output_tokens_per_s"])
    assert config["throughput_ratio"] == pytest.approx(
        ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
    )
    assert config["copy_bytes_reduction"] == pytest.approx(
        hf["kv_bytes_copied_total"] / ours["kv_bytes_copied_total"]
    )
    # Copy-on-write forks copy only partial blocks: fewer bytes than HF's reordering.
    assert config["copy_bytes_reduction"] > 1
    extra = ours["extra"]
    assert ours["kv_bytes_copied_total"] == extra["blocks_copied_total"] * extra[
        "kv_bytes_per_block"]  # fmt: skip


def test_prefix_caching_benchmark_hits_only_where_prompts_share(tmp_path):
    result = run(
        "prefix_caching", tmp_path / "p.json",
        "--num-requests", "4", "--shared-len", "48", "--unique-len", "20", "--output-len", "2",
        "--conversations", "2", "--turns", "2", "--repeats", "1",
    )  # fmt: skip
    on, off = result["caching_on"], result["caching_off"]
    assert set(on) == set(off) == {"shared", "multi_turn", "unique"}
    # 16-token blocks: 3 of each 68-token shared prompt's 4 full blocks are the shared 48.
    assert on["shared"]["hit_rate"] > 0.3 and on["multi_turn"]["hit_rate"] > 0.2
    assert on["unique"]["hit_rate"] == 0 and off["shared"]["hit_rate"] is None
    workload = result["workload"]
    for setting in (on, off):
        for name, row in setting.items():
            (one,) = row["runs"]
            # Every request's output, EOS ignored (num_requests, or conversations x turns).
            assert one["output_tokens"] == 4 * 2, name
            assert row["tokens_per_s"] == pytest.approx(one["output_tokens"] / row["wall_s"])
            if row["hit_rate"] is not None:
                assert row["hit_rate"] == pytest.approx(one["hits"] / one["queries"])
    assert workload["num_requests"] == 4
    for name, ratios in result["ratios"].items():
        assert ratios["ttft_median_off/on"] == pytest.approx(
            off[name]["ttft_median_s"] / on[name]["ttft_median_s"]
        )
        assert ratios["throughput_on/off"] == pytest.approx(
            on[name]["tokens_per_s"] / off[name]["tokens_per_s"]
        )
