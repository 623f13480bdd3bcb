"""Kernel benchmark (GPU): paged attention against SDPA and against the device's copy bandwidth.

Decode: batch {1, 8, 32, 128, 256} x context {128, 512, 1024}, GPT-2 small heads (12 x 64),
fp16, block size 16, blocks scattered through a large cache. Bandwidth = K/V bytes read /
time; compared with SDPA on the same keys gathered densely ([B, H, ctx, D], gather not
timed) and with the measured device-to-device copy bandwidth (read + write bytes / time of
a 1 GiB copy). Prefill: causal self-attention of batch x length prompts; TFLOP/s =
2 * 2 * B * H * L^2 * D / 2 / time (causal half), against SDPA(is_causal=True) on dense data.

Goals (issue 5): decode >= 70% of copy bandwidth at batch >= 64 and context >= 512;
prefill >= 80% of SDPA's TFLOP/s.

    .venv/bin/python benchmarks/kernel_bench.py            # needs a CUDA device
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

try:
    import kernels  # noqa: F401
except ImportError:  # run as a plain script on a machine without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.paged_attention import paged_attention  # noqa: E402

HEADS, HEAD_DIM, BLOCK_SIZE = 12, 64, 16
DTYPE = torch.float16
DECODE_BATCHES = [1, 8, 32, 128, 256]
DECODE_CONTEXTS = [128, 512, 1024]
PREFILL_SHAPES = [(1, 512), (1, 1024), (8, 512), (8, 1024), (32, 512)]
COPY_BYTES = 1 << 30


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def copy_bandwidth() -> float:
    """Bytes per second moved (read + write) by a device-to-device copy."""
    src = torch.empty(COPY_BYTES // 2, dtype=DTYPE, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(partial(dst.copy_, src))
    return 2 * COPY_BYTES / (ms / 1e3)


def paged_inputs(batch: int, context: int, query_len: int):
    """Caches with each sequence's blocks at random places, plus the dense view of them."""
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq * 2 + 1
    shape = (num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    ids = (torch.randperm(num_blocks - 1, device="cuda") + 1)[: batch * per_seq]
    block_tables = ids.view(batch, per_seq).to(torch.int32)
    positions = torch.arange(context, device="cuda")
    blocks = block_tables.long()[:, positions // BLOCK_SIZE]
    dense_k = k_cache[blocks, positions % BLOCK_SIZE].transpose(1, 2).contiguous()
    dense_v = v_cache[blocks, positions % BLOCK_SIZE].transpose(1, 2).contiguous()
    q = torch.randn((batch * query_len, HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * query_len
    return q, k_cache, v_cache, block_tables, seq_lens, cu, dense_k, dense_v


def bench_decode(copy_bw: float) -> list[dict]:
    rows = []
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            q, kc, vc, bt, sl, cu, dk, dv = paged_inputs(batch, context, 1)
            out = torch.empty_like(q)
            scale = HEAD_DIM**-0.5
            ours = time_ms(partial(paged_attention, q, kc, vc, bt, sl, cu, 1, context, out, scale))
            dense_q = q.view(batch, HEADS, 1, HEAD_DIM)
            sdpa = time_ms(partial(F.scaled_dot_product_attention, dense_q, dk, dv))
            kv_bytes = 2 * batch * context * HEADS * HEAD_DIM * DTYPE.itemsize
            bw = kv_bytes / (ours / 1e3)
            rows.append({
                "batch": batch, "context": context, "ours_ms": ours, "sdpa_ms": sdpa,
                "ours_gbps": bw / 1e9, "sdpa_gbps": kv_bytes / (sdpa / 1e3) / 1e9,
                "fraction_of_copy_bw": bw / copy_bw,
            })  # fmt: skip
            print(
                f"decode b={batch:4d} ctx={context:5d}: {ours * 1e3:8.1f} us "
                f"{bw / 1e9:7.1f} GB/s ({bw / copy_bw:.0%} of copy), SDPA {sdpa * 1e3:8.1f} us"
            )
    return rows


def bench_prefill() -> list[dict]:
    rows = []
    for batch, length in PREFILL_SHAPES:
        q, kc, vc, bt, sl, cu, dk, dv = paged_inputs(batch, length, length)
        out = torch.empty_like(q)
        scale = HEAD_DIM**-0.5
        ours = time_ms(partial(paged_attention, q, kc, vc, bt, sl, cu, length, length, out, scale))
        dense_q = q.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        sdpa = time_ms(partial(F.scaled_dot_product_attention, dense_q, dk, dv, is_causal=True))
        flops = 2 * 2 * batch * HEADS * length * length * HEAD_DIM / 2
        rows.append({
            "batch": batch, "length": length, "ours_ms": ours, "sdpa_ms": sdpa,
            "ours_tflops": flops / (ours / 1e3) / 1e12, "sdpa_tflops": flops / (sdpa / 1e3) / 1e12,
            "fraction_of_sdpa": sdpa / ours,
        })  # fmt: skip
        print(
            f"prefill b={batch:3d} L={length:5d}: {flops / (ours / 1e3) / 1e12:6.1f} TFLOP/s, "
            f"SDPA {flops / (sdpa / 1e3) / 1e12:6.1f} ({sdpa / ours:.0%})"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--result-file", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench needs a CUDA device")
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    print(f"{device}: device-to-device copy {copy_bw / 1e9:.0f} GB/s")
    decode = bench_decode(copy_bw)
    prefill = bench_prefill()
    goal_rows = [r for r in decode if r["batch"] >= 64 and r["context"] >= 512]
    result = {
        "benchmark": "kernel_bench",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "device": device,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "settings": {
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": str(DTYPE),
        },
        "copy_bandwidth_gbps": copy_bw / 1e9,
        "decode": decode,
        "prefill": prefill,
        "goals": {
            "decode_min_fraction_of_copy_bw": min(r["fraction_of_copy_bw"] for r in goal_rows),
            "decode_goal_met": all(r["fraction_of_copy_bw"] >= 0.7 for r in goal_rows),
            "prefill_min_fraction_of_sdpa": min(r["fraction_of_sdpa"] for r in prefill),
            "prefill_goal_met": all(r["fraction_of_sdpa"] >= 0.8 for r in prefill),
        },
    }
    slug = device.lower().replace(" ", "_")
    path = args.result_file or Path(__file__).parent / "results" / f"kernel_bench_{slug}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
