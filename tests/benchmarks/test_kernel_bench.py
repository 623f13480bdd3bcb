"""benchmarks/kernel_bench.py runs end to end (--smoke: tiny shapes, the interpreter on CPU),
so a GPU session spends its minutes measuring, not debugging the script. No speed is checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import kernel_bench
from octavo.kernels.paged_attention import choose_num_splits, num_sms

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_kernel_bench_smoke_writes_its_result(tmp_path):
    result_file = tmp_path / "kernel_bench.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.kernel_bench",
        "--smoke",
        "--sweep",
        "--result-file",
        str(result_file),
    ]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    check_result(json.loads(result_file.read_text()))


def check_result(result: dict) -> None:
    # The device the script ran on: CUDA where there is one, else the CPU.
    sms = num_sms(torch.device("cuda" if torch.cuda.is_available() else "cpu"))

    settings = result["settings"]
    assert settings["smoke"] is True and settings["dtype"] == "torch.float32"
    heads, head_dim, itemsize = settings["heads"], settings["head_dim"], 4  # float32
    # Every shape the settings name, once each, in their order.
    assert [(r["batch"], r["context"]) for r in result["decode"]] == [
        (b, c) for b in settings["decode_batches"] for c in settings["decode_contexts"]
    ]
    assert [[r["batch"], r["length"]] for r in result["prefill"]] == settings["prefill_shapes"]
    copy_bytes_per_s = result["copy_bandwidth_gbps"] * 1e9
    assert copy_bytes_per_s > 0
    for row in result["decode"] + result["prefill"]:
        assert row["ours_ms"] > 0 and row["sdpa_ms"] > 0
    # Rates follow from the times and the bytes each kernel must read (decode: K and V of
    # every token of the context) or the FLOPs it must do (prefill, causal: half of them).
    for row in result["decode"]:
        kv_bytes = 2 * row["batch"] * row["context"] * heads * head_dim * itemsize
        ours, sdpa = row["ours_ms"] / 1e3, row["sdpa_ms"] / 1e3
        assert row["ours_gbps"] == pytest.approx(kv_bytes / ours / 1e9, rel=1e-9)
        assert row["sdpa_gbps"] == pytest.approx(kv_bytes / sdpa / 1e9, rel=1e-9)
        fraction = kv_bytes / ours / copy_bytes_per_s
        assert row["fraction_of_copy_bw"] == pytest.approx(fraction, rel=1e-9)
        assert row["num_splits"] == choose_num_splits(row["batch"], heads, row["context"], sms)
    for row in result["prefill"]:
        flops = 2 * 2 * row["batch"] * heads * row["length"] ** 2 * head_dim / 2
        ours, sdpa = row["ours_ms"] / 1e3, row["sdpa_ms"] / 1e3
        assert row["ours_tflops"] == pytest.approx(flops / ours / 1e12, rel=1e-9)
        assert row["sdpa_tflops"] == pytest.approx(flops / sdpa / 1e12, rel=1e-9)
        assert row["fraction_of_sdpa"] == pytest.approx(sdpa / ours, rel=1e-9)
    # The sweep: every candidate config (and split factor) on every sweep shape, once.
    sweep = result["sweep"]
    assert [(r["batch"], r["context"], r["config"], r["num_splits"]) for r in sweep["decode"]] == [
        (batch, context, config, splits)
        for batch, context in settings["sweep_decode_shapes"]
        for config in settings["decode_candidates"]
        for splits in settings["decode_split_candidates"]
    ]
    assert [(r["batch"], r["length"], r["config"]) for r in sweep["prefill"]] == [
        (batch, length, config)
        for batch, length in settings["sweep_prefill_shapes"]
        for config in settings["prefill_candidates"]
    ]
    for row in sweep["decode"]:
        assert "error" not in row and row["ms"] > 0
        kv_bytes = 2 * row["batch"] * row["context"] * heads * head_dim * itemsize
        fraction = kv_bytes / (row["ms"] / 1e3) / copy_bytes_per_s
        assert row["fraction_of_copy_bw"] == pytest.approx(fraction, rel=1e-9)
    for row in sweep["prefill"]:
        assert "error" not in row and row["ms"] > 0
        flops = 2 * 2 * row["batch"] * heads * row["length"] ** 2 * head_dim / 2
        assert row["tflops"] == pytest.approx(flops / (row["ms"] / 1e3) / 1e12, rel=1e-9)
    # The goals, read off the rows they name: no smoke decode row is large enough.
    goal_rows = [
        r
        for r in result["decode"]
        if r["batch"] >= kernel_bench.GOAL_MIN_BATCH
        and r["context"] >= kernel_bench.GOAL_MIN_CONTEXT
    ]
    assert goal_rows == []
    fractions = [r["fraction_of_sdpa"] for r in result["prefill"]]
    assert result["goals"] == {
        "decode_min_fraction_of_copy_bw": None,
        "decode_goal_met": False,
        "prefill_min_fraction_of_sdpa": min(fractions),
        "prefill_goal_met": all(f >= kernel_bench.PREFILL_GOAL for f in fractions),
    }
