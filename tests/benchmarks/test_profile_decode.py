"""benchmarks/profile_decode.py runs end to end (--smoke: a 2-layer model on the CPU), so a GPU
session spends its minutes profiling. No speed is checked; each figure agrees with the ones it
is computed from."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import common, profile_decode

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# The engine phases of one step that do not run inside one another.
DISJOINT_PHASES = ("schedule", "execute.host_inputs", "execute.forward", "execute.sample",
                   "update", "outputs")  # fmt: skip
# Phases only a CUDA step has.
CUDA_PHASES = ("execute.graph_replay", "execute.forward_piecewise", "execute.triton_launches")
LAYERS, HIDDEN, _ = common.SMOKE_PRESET
KV_BYTES_PER_TOKEN = LAYERS * 2 * HIDDEN * 4  # K and V of every layer, float32


def run_smoke(tmp_path, *flags: str) -> dict:
    result_file = tmp_path / "profile_decode.json"
    command = [sys.executable, "-m", "benchmarks.profile_decode", "--smoke",
               "--result-file", str(result_file), *flags]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(result_file.read_text())


def smoke_weight_bytes() -> int:
    """The smoke GPT-2's float32 weights, the LM head tied to the token embedding."""
    embeddings = (common.GPT2_VOCAB + common.GPT2_N_POSITIONS) * HIDDEN
    # Per block: 2 layer norms, attention (qkv and out) and the MLP (4x), with biases.
    block = 2 * 2 * HIDDEN + (3 + 1) * HIDDEN * (HIDDEN + 1) + 2 * 4 * HIDDEN * HIDDEN
    block += 4 * HIDDEN + HIDDEN
    return 4 * (embeddings + LAYERS * block + 2 * HIDDEN)


def check_rows(result: dict, arrivals: int) -> None:
    """What holds for every row, with or without arrivals."""
    settings = result["settings"]
    assert settings["smoke"] is True and settings["preset"] == "smoke"
    assert settings["dtype"] == "float32" and settings["arrivals"] == arrivals
    steps, warmup = profile_decode.SMOKE_STEPS, profile_decode.SMOKE_WARMUP
    assert (settings["steps"], settings["warmup_steps"]) == (steps, warmup)
    assert [r["batch"] for r in result["rows"]] == list(profile_decode.SMOKE_BATCHES)
    assert settings["batches"] == list(profile_decode.SMOKE_BATCHES)
    # No CUDA device: no copy bandwidth, GPU-busy figure or roofline, never a made-up one.
    assert result["copy_bandwidth_gbps"] is None
    for row in result["rows"]:
        batch = row["batch"]
        # Every sequence samples one token per timed step (arrivals too: their prefill
        # samples one), over the steps' own time.
        assert row["generated_tokens_per_s"] == pytest.approx(
            batch / (row["step_ms_mean"] / 1e3), rel=1e-9
        )
        assert row["output_tokens_per_s"] == pytest.approx(
            batch / (row["step_ms_median"] / 1e3), rel=1e-9
        )
        assert row["prompt_tokens_per_step"] == arrivals * settings["arrival_prompt_len"]
        assert row["step_ms_median"] > 0 and row["profiled_step_ms"] > 0
        for key in ("roofline_step_ms", "fraction_of_roofline", "gpu_busy_ms_per_step",
                    "gpu_busy_fraction", "kernels_per_step"):  # fmt: skip
            assert row[key] is None, key
        assert row["top_kernels"] == []
        # Every weight once, and the K and V of whole tokens.
        kv_bytes = row["bytes_per_step"] - smoke_weight_bytes()
        assert kv_bytes > 0 and kv_bytes % KV_BYTES_PER_TOKEN == 0
        # The host's own ops, dearest first, the step's annotation not among them.
        ops = row["top_host_ops"]
        assert 0 < len(ops) <= 12
        assert all(op["count"] >= 1 and op["name"] != profile_decode.STEP_ANNOTATION for op in ops)
        assert [op["self_cpu_us"] for op in ops] == sorted(
            (op["self_cpu_us"] for op in ops), reverse=True
        )
        # The engine's phases per step, under cProfile: each within the step, the ones that
        # do not nest together too; on the CPU none of CUDA's.
        phases = row["host_phases_ms_per_step"]
        assert set(phases) == {"step_total_under_cprofile", *(p[0] for p in profile_decode.PHASES)}
        total = phases["step_total_under_cprofile"]
        assert sum(phases[p] for p in DISJOINT_PHASES) <= total
        assert all(phases[p] > 0 for p in DISJOINT_PHASES)
        assert all(phases[p] == 0 for p in CUDA_PHASES)


def test_profile_decode_smoke_writes_its_result(tmp_path):
    check_decode_only(run_smoke(tmp_path))


def check_decode_only(result: dict) -> None:
    check_rows(result, arrivals=0)
    settings = result["settings"]
    for row in result["rows"]:
        # Measured in the middle of the wall pass: the batch's prompts, the warm-up steps
        # and half the timed steps computed, for each sequence.
        tokens = settings["prompt_len"] + settings["warmup_steps"] + settings["steps"] // 2
        kv_bytes = row["batch"] * tokens * KV_BYTES_PER_TOKEN
        assert row["bytes_per_step"] == smoke_weight_bytes() + kv_bytes


def test_arrivals_make_every_timed_step_a_mixed_one(tmp_path):
    """--arrivals 1: one prompt of --arrival-prompt-len tokens admitted before each timed
    step, the batch kept at its size."""
    check_arrivals(run_smoke(tmp_path, "--arrivals", "1", "--arrival-prompt-len", "5"))


def check_arrivals(result: dict) -> None:
    assert result["settings"]["arrival_prompt_len"] == 5
    assert result["settings"]["prefill_interval"] == 1  # the engine's default on a CPU
    check_rows(result, arrivals=1)
