"""Every kernel specialization GPT-2 and GPTBigCode launch compiles for real GPUs (sm_80,
sm_90) through Triton's NVIDIA pipeline, with no spills, shared memory within a block's
limit, tensor cores in the prefill tl.dot path and 16-byte loads wherever K/V bytes or
activations are moved.

The interpreter that runs the kernels elsewhere in the suite cannot see any of this."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from octavo.kernels.paged_attention import MIN_DOT_DIM
from tools.aot import NARROW_HEAD_DIM

pytestmark = pytest.mark.slow

ARCHS = (80, 90)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def variants(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("aot")
    # Processes of their own: this one runs the kernels under TRITON_INTERPRET=1. One per
    # architecture, at once: compiling is single-threaded and the suite's longest setup.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "tools.aot", "--arch"]
    runs = {
        arch: subprocess.Popen(
            [*command, str(arch), "--json", str(folder / f"sm{arch}.json")],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for arch in ARCHS
    }
    found = []
    for arch, run in runs.items():
        output, _ = run.communicate()
        assert run.returncode == 0, output
        found += json.loads((folder / f"sm{arch}.json").read_text())
    return found


def _dtype(variant: dict) -> str:
    """The cache's element type (every attention kernel but the reduce reads or writes the
    cache), or the activations' for the LayerNorm."""
    signature = variant["signature"]
    return signature.get("k_cache_ptr") or signature.get("cache_ptr") or signature.get("x_ptr", "")


def test_every_kernel_compiles_for_every_arch_and_dtype(variants):
    kernels = {
        "_prefill_kernel", "_decode_kernel", "_copy_blocks_kernel", "_add_layer_norm_kernel",
    }  # fmt: skip
    for arch in ARCHS:
        for dtype in ("*fp16", "*bf16", "*fp32"):
            built = {
                v["kernel"]
                for v in variants
                if v["arch"] == arch and v["kernel"] in kernels and _dtype(v) == dtype
            }
            assert built == kernels, (arch, dtype)
        splits = {
            v["constexprs"]["SPLITS"]
            for v in variants
            if v["arch"] == arch and v["kernel"] == "_reduce_splits_kernel"
        }
        assert splits == {2, 4, 8, 16}
        plane_strides = {
            v["signature"]["plane_stride"]
            for v in variants
            if v["arch"] == arch and v["kernel"] == "_copy_blocks_kernel"
        }
        assert plane_strides == {"i32", "i64"}  # small caches and caches past 2**31 elements


def test_grouped_query_kernels_compile_in_every_dtype(variants):
    """A multi-query model's launches (12 query heads on one K/V head) are among them, so
    the grouped specializations meet the same checks."""
    for arch in ARCHS:
        grouped = {
            (v["kernel"], _dtype(v))
            for v in variants
            if v["arch"] == arch and v["constexprs"].get("GROUP_SIZE") == 12
        }
        assert grouped == {
            (kernel, dtype)
            for kernel in ("_prefill_kernel", "_decode_kernel")
            for dtype in ("*fp16", "*bf16", "*fp32")
        }, arch


def test_what_changes_with_the_batch_compiles_no_variant_of_its_own(variants):
    """A mixed batch's tl.dot launch reads the batch from `num_decodes` rows in (the
    workload launches it at 0 and 1 rows in), the block tables' row stride is their width
    (1, 16 and 64 blocks in the workload) and the decode split count varies (1 to 16): each
    kernel compiles once regardless, so serving never waits on a compile because a batch
    changed a pointer's alignment or an integer's value."""
    for kernel in ("_prefill_kernel", "_decode_kernel", "_reduce_splits_kernel"):
        keys = [
            (v["arch"], json.dumps(v["signature"], sort_keys=True),
             json.dumps(v["constexprs"], sort_keys=True))
            for v in variants
            if v["kernel"] == kernel
        ]  # fmt: skip
        assert len(keys) == len(set(keys)), kernel
        constants = {name for v in variants if v["kernel"] == kernel for name in v["constexprs"]}
        assert not constants & {"bt_stride_s", "num_splits"}, kernel


def test_a_head_narrower_than_a_dot_compiles_padded_to_it(variants):
    """tl.dot refuses an inner dimension under 16 on the GPU (the interpreter does not): the
    prefill path pads a narrow head (8 here) with masked lanes, so it compiles."""
    for arch in ARCHS:
        narrow = {
            (v["kernel"], v["constexprs"]["BLOCK_D"])
            for v in variants
            if v["arch"] == arch and v["constexprs"].get("HEAD_DIM") == NARROW_HEAD_DIM
        }
        assert ("_prefill_kernel", MIN_DOT_DIM) in narrow, arch
        assert ("_decode_kernel", NARROW_HEAD_DIM) in narrow, arch  # no tl.dot there


def test_no_spills_and_shared_memory_fits(variants):
    assert [v for v in variants if v["problems"]] == []
    assert all(v["usage"]["spill_bytes"] == 0 for v in variants)


def test_dot_kernels_use_tensor_cores_in_16_bit(variants):
    for v in variants:
        if v["kernel"] == "_prefill_kernel" and _dtype(v) in ("*fp16", "*bf16"):
            assert v["tensor_core_ops"] > 0, v


def test_kv_bytes_move_in_16_byte_loads(variants):
    for v in variants:
        if v["kernel"] in (
            "_prefill_kernel",
            "_decode_kernel",
            "_copy_blocks_kernel",
            "_add_layer_norm_kernel",
        ):
            if v["constexprs"].get("HEAD_DIM") == NARROW_HEAD_DIM:
                continue  # the narrow head below: compiled for correctness, not speed
            assert v["vector_loads"] > 0, v
