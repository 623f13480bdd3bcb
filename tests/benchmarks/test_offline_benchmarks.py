"""The offline benchmarks run end to end on a tiny model (Octavo and its HF peers), so a GPU
session spends its minutes measuring. Correctness fields are checked; speeds never are."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--layers", "1", "--hidden", "64", "--heads", "2", "--vocab", "512"]


def run(script: str, result_file: Path, *args: str) -> dict:
    command = [
        sys.executable,
        f"benchmarks/{script}",
        *TINY,
        *args,
        "--result-file",
        str(result_file),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(result_file.read_text())


def test_offline_throughput_against_both_hf_peers(tmp_path):
    result = run(
        "offline_throughput.py", tmp_path / "o.json",
        "--num-requests", "4", "--prompt-len", "4", "8", "--output-len", "2", "4", "--repeats", "1",
    )  # fmt: skip
    assert set(result["systems"]) == {"octavo", "hf_static", "hf_cb"}
    assert all(v is not None and v > 0 for v in result["ratios"].values())
    for key in ("greedy_match", "greedy_match_hf_cb"):
        assert result[key]["matched"] == result[key]["compared"] == 4


def test_beam_bench_against_hf(tmp_path):
    result = run(
        "beam_bench.py", tmp_path / "b.json",
        "--widths", "2", "--prompt-lens", "8", "--num-requests", "2", "--max-tokens", "4",
        "--noisy-retries", "0",
    )  # fmt: skip
    (config,) = result["results"].values()
    assert config["best_beam_match"]["matched"] == config["best_beam_match"]["compared"] == 2
    assert config["throughput_ratio"] > 0 and config["copy_bytes_reduction"] > 0


def test_prefix_caching_benchmark_hits_only_where_prompts_share(tmp_path):
    result = run(
        "prefix_caching.py", tmp_path / "p.json",
        "--num-requests", "4", "--shared-len", "48", "--unique-len", "20", "--output-len", "2",
        "--conversations", "2", "--turns", "2", "--repeats", "1",
    )  # fmt: skip
    on, off = result["caching_on"], result["caching_off"]
    assert set(on) == set(off) == {"shared", "multi_turn", "unique"}
    # 16-token blocks: 3 of each 68-token shared prompt's 4 full blocks are the shared 48.
    assert on["shared"]["hit_rate"] > 0.3 and on["multi_turn"]["hit_rate"] > 0.2
    assert on["unique"]["hit_rate"] == 0 and off["shared"]["hit_rate"] is None
    assert all(r["ttft_median_off/on"] > 0 for r in result["ratios"].values())
