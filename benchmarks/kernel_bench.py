"""Kernel benchmark (GPU): paged attention against SDPA and against the device's copy bandwidth.

Decode: batch {1, 8, 32, 64, 128, 256} x context {128, 512, 1024}, GPT-2 small heads
(12 x 64), fp16, block size 16, blocks scattered through a large cache. Bandwidth = K/V bytes
read / time; compared with SDPA on the same keys gathered densely ([B, H, ctx, D], gather not
timed) and with the measured device-to-device copy bandwidth (read + write bytes / time of
a 1 GiB copy). Prefill: causal self-attention of batch x length prompts; TFLOP/s =
2 * 2 * B * H * L^2 * D / 2 / time (causal half), against SDPA(is_causal=True) on dense data.
Every call is timed from CUDA graph replays (as the engine runs decode steps: no launch
overhead), rotating over enough input sets that K/V come from device memory, not L2.
--sweep also times every decode launch config x split factor over a grid of batch x
context, and prefill tile configs, to pick the heuristics from.

Goals: decode >= 70% of copy bandwidth at batch >= 64 and context >= 512;
prefill >= 80% of SDPA's TFLOP/s.

    .venv/bin/python -m benchmarks.kernel_bench            # needs a CUDA device
    .venv/bin/python -m benchmarks.kernel_bench --smoke --result-file /tmp/k.json

--smoke runs tiny shapes on whatever device there is (on CPU, the Triton interpreter): it
checks that the script works, and its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

# Without a GPU (--smoke) the kernels run in the interpreter, which must be chosen before
# triton is imported (triton.language's own jit functions are decorated at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton.testing  # noqa: E402

from benchmarks.copy_bandwidth import device_copy_bandwidth  # noqa: E402
from octavo.kernels.paged_attention import (  # noqa: E402
    DecodeConfig,
    PrefillConfig,
    choose_num_splits,
    num_sms,
    paged_attention,
)

HEAD_DIM, BLOCK_SIZE = 64, 16
# Rows that the decode goal applies to.
GOAL_MIN_BATCH, GOAL_MIN_CONTEXT = 64, 512
DECODE_GOAL, PREFILL_GOAL = 0.7, 0.8
# CPU timing (smoke runs): calls averaged after one warm-up call.
CPU_TIMING_REPS = 2
# CUDA timing: graph replays per measurement (the median is kept), and input sets rotated
# through until one replay reads this many times the L2 cache (at most MAX_INPUT_SETS sets).
GRAPH_REPLAYS = 20
L2_MULTIPLE = 2
MAX_INPUT_SETS = 32


@dataclass(frozen=True)
class Shapes:
    """What one run measures: GPT-2 small's heads, fp16 on the GPU."""

    heads: int
    dtype: torch.dtype
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_shapes: tuple[tuple[int, int], ...]  # (batch, length)
    copy_bytes: int
    # --sweep: launch configs timed on a few shapes, to pick the heuristics from.
    sweep_decode_shapes: tuple[tuple[int, int], ...]  # (batch, context)
    sweep_prefill_shapes: tuple[tuple[int, int], ...]  # (batch, length)
    decode_candidates: tuple[DecodeConfig, ...]
    decode_split_candidates: tuple[int, ...]
    prefill_candidates: tuple[PrefillConfig, ...]


FULL = Shapes(
    heads=12,
    dtype=torch.float16,
    decode_batches=(1, 8, 32, 64, 128, 256),
    decode_contexts=(128, 512, 1024),
    prefill_shapes=((1, 512), (1, 1024), (8, 512), (8, 1024), (32, 512)),
    copy_bytes=1 << 30,
    sweep_decode_shapes=tuple(
        (batch, context) for batch in (1, 8, 32, 64, 128, 256) for context in (128, 512, 1024)
    ),
    sweep_prefill_shapes=((1, 1024), (8, 512), (32, 512)),
    decode_candidates=tuple(
        DecodeConfig(block_n, num_warps) for block_n in (32, 64, 128) for num_warps in (2, 4, 8)
    ),
    decode_split_candidates=(1, 2, 4, 8),
    prefill_candidates=tuple(
        PrefillConfig(block_m, block_n, num_warps, num_stages)
        for block_m, block_n, num_warps in (
            (64, 32, 4),
            (64, 64, 4),
            (64, 128, 4),
            (128, 32, 8),
            (128, 64, 8),
            (128, 128, 8),
        )
        for num_stages in (2, 3)
    ),  # fmt: skip
)
SMOKE = Shapes(
    heads=2,
    dtype=torch.float32,
    decode_batches=(1, 2),
    decode_contexts=(24,),
    prefill_shapes=((1, 20),),
    copy_bytes=1 << 20,
    sweep_decode_shapes=((2, 24),),
    sweep_prefill_shapes=((1, 20),),
    decode_candidates=(DecodeConfig(16, num_warps=2), DecodeConfig(32)),
    decode_split_candidates=(1,),
    prefill_candidates=(PrefillConfig(16, 16), PrefillConfig(16, 32, num_stages=2)),
)


def time_ms(calls: list[Callable[[], object]], device: torch.device) -> float:
    """Time of one call. On CUDA: all calls captured in one CUDA graph (as the engine replays
    its decode steps: no launch overhead), the median replay over GRAPH_REPLAYS divided by
    the number of calls. The calls should rotate over input sets (see input_sets) so that
    they read device memory, not the L2 cache. On the CPU: the first call, averaged."""
    if device.type != "cuda":
        calls[0]()
        start = time.perf_counter()
        for _ in range(CPU_TIMING_REPS):
            calls[0]()
        return (time.perf_counter() - start) / CPU_TIMING_REPS * 1e3
    for call in calls:  # compiles, and allocates outside the graph's capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(GRAPH_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)


def num_input_sets(device: torch.device, bytes_read: int) -> int:
    """Input sets to rotate over so that one graph replay reads L2_MULTIPLE x the L2 cache."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(MAX_INPUT_SETS, -(-L2_MULTIPLE * l2 // bytes_read)))


def copy_bandwidth(shapes: Shapes, device: torch.device) -> float:
    """Bytes per second moved (read + write) by a device-to-device copy."""
    if device.type == "cuda":
        return device_copy_bandwidth(device, shapes.copy_bytes)
    src = torch.empty(shapes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms([partial(dst.copy_, src)], device)
    return 2 * shapes.copy_bytes / (ms / 1e3)


def paged_inputs(shapes: Shapes, device: torch.device, batch: int, context: int, query_len: int):
    """Caches with each sequence's blocks at random places, plus the dense view of them."""
    heads, dtype = shapes.heads, shapes.dtype
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq * 2 + 1
    shape = (num_blocks, BLOCK_SIZE, heads, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    ids = (torch.randperm(num_blocks - 1, device=device) + 1)[: batch * per_seq]
    block_tables = ids.view(batch, per_seq).to(torch.int32)
    positions = torch.arange(context, device=device)
    blocks = block_tables.long()[:, positions // BLOCK_SIZE]
    dense_k = k_cache[blocks, positions % BLOCK_SIZE].transpose(1, 2).contiguous()
    dense_v = v_cache[blocks, positions % BLOCK_SIZE].transpose(1, 2).contiguous()
    q = torch.randn((batch * query_len, heads, HEAD_DIM), dtype=dtype, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * query_len
    return q, k_cache, v_cache, block_tables, seq_lens, cu, dense_k, dense_v


def input_sets(shapes: Shapes, device: torch.device, batch: int, context: int, query_len: int):
    """paged_inputs, as many independent sets as num_input_sets asks for the K/V bytes."""
    kv_bytes = 2 * batch * context * shapes.heads * HEAD_DIM * shapes.dtype.itemsize
    count = num_input_sets(device, kv_bytes)
    return [paged_inputs(shapes, device, batch, context, query_len) for _ in range(count)]


def bench_decode(shapes: Shapes, device: torch.device, copy_bw: float) -> list[dict]:
    rows = []
    heads, scale = shapes.heads, HEAD_DIM**-0.5
    for batch in shapes.decode_batches:
        for context in shapes.decode_contexts:
            sets = input_sets(shapes, device, batch, context, 1)
            ours = time_ms(
                [
                    partial(paged_attention, q, kc, vc, bt, sl, cu, 1, context,
                            torch.empty_like(q), scale)
                    for q, kc, vc, bt, sl, cu, _, _ in sets
                ],
                device,
            )  # fmt: skip
            sdpa = time_ms(
                [
                    partial(F.scaled_dot_product_attention, q.view(batch, heads, 1, HEAD_DIM),
                            dk, dv)
                    for q, _, _, _, _, _, dk, dv in sets
                ],
                device,
            )  # fmt: skip
            del sets
            kv_bytes = 2 * batch * context * heads * HEAD_DIM * shapes.dtype.itemsize
            bw = kv_bytes / (ours / 1e3)
            splits = choose_num_splits(batch, heads, context, num_sms(device))
            rows.append({
                "batch": batch, "context": context, "num_splits": splits,
                "ours_ms": ours, "sdpa_ms": sdpa,
                "ours_gbps": bw / 1e9, "sdpa_gbps": kv_bytes / (sdpa / 1e3) / 1e9,
                "fraction_of_copy_bw": bw / copy_bw,
            })  # fmt: skip
            print(
                f"decode b={batch:4d} ctx={context:5d}: {ours * 1e3:8.1f} us "
                f"{bw / 1e9:7.1f} GB/s ({bw / copy_bw:.0%} of copy), SDPA {sdpa * 1e3:8.1f} us"
            )
    return rows


def bench_prefill(shapes: Shapes, device: torch.device) -> list[dict]:
    rows = []
    heads, scale = shapes.heads, HEAD_DIM**-0.5
    for batch, length in shapes.prefill_shapes:
        q, kc, vc, bt, sl, cu, dk, dv = paged_inputs(shapes, device, batch, length, length)
        ours = time_ms(
            [partial(paged_attention, q, kc, vc, bt, sl, cu, length, length,
                     torch.empty_like(q), scale)],
            device,
        )  # fmt: skip
        dense_q = q.view(batch, length, heads, HEAD_DIM).transpose(1, 2).contiguous()
        sdpa = time_ms(
            [partial(F.scaled_dot_product_attention, dense_q, dk, dv, is_causal=True)], device
        )
        flops = 2 * 2 * batch * heads * length * length * HEAD_DIM / 2
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


def bench_sweep(shapes: Shapes, device: torch.device, copy_bw: float) -> dict[str, list[dict]]:
    """Times every candidate launch config on the sweep shapes; a config the device cannot
    run (out of shared memory or registers) is recorded with its error. Decode rows report
    the fraction of copy bandwidth, prefill rows TFLOP/s."""
    heads, scale = shapes.heads, HEAD_DIM**-0.5
    rows: dict[str, list[dict]] = {"decode": [], "prefill": []}
    for batch, context in shapes.sweep_decode_shapes:
        sets = input_sets(shapes, device, batch, context, 1)
        kv_bytes = 2 * batch * context * heads * HEAD_DIM * shapes.dtype.itemsize
        candidates = []
        for config in shapes.decode_candidates:
            for splits in shapes.decode_split_candidates:
                if splits > 1 and context // splits < config.block_n:
                    continue  # splits with no keys
                runs = [
                    partial(paged_attention, q, kc, vc, bt, sl, cu, 1, context,
                            torch.empty_like(q), scale, splits, decode=config)
                    for q, kc, vc, bt, sl, cu, _, _ in sets
                ]  # fmt: skip
                row = {
                    "batch": batch, "context": context, "config": asdict(config),
                    "num_splits": splits,
                }  # fmt: skip
                row |= _timed(runs, device)
                if "ms" in row:
                    row["fraction_of_copy_bw"] = kv_bytes / (row["ms"] / 1e3) / copy_bw
                candidates.append(row)
        del sets
        _print_best(f"decode b={batch} ctx={context}", candidates, "fraction_of_copy_bw")
        rows["decode"] += candidates
    for batch, length in shapes.sweep_prefill_shapes:
        q, kc, vc, bt, sl, cu, _, _ = paged_inputs(shapes, device, batch, length, length)
        flops = 2 * 2 * batch * heads * length * length * HEAD_DIM / 2
        candidates = []
        for config in shapes.prefill_candidates:
            run = partial(
                paged_attention, q, kc, vc, bt, sl, cu, length, length, torch.empty_like(q),
                scale, prefill=config,
            )  # fmt: skip
            row = {"batch": batch, "length": length, "config": asdict(config)}
            row |= _timed([run], device)
            if "ms" in row:
                row["tflops"] = flops / (row["ms"] / 1e3) / 1e12
            candidates.append(row)
        _print_best(f"prefill b={batch} L={length}", candidates, "tflops")
        rows["prefill"] += candidates
    return rows


def _timed(runs: list[Callable[[], object]], device: torch.device) -> dict:
    try:
        return {"ms": time_ms(runs, device)}
    except Exception as error:  # noqa: BLE001 -- a config the device rejects is a result
        return {"error": f"{type(error).__name__}: {error}"[:200]}


def _print_best(label: str, candidates: list[dict], metric: str) -> None:
    ran = [r for r in candidates if "ms" in r]
    failed = len(candidates) - len(ran)
    if ran:
        best = min(ran, key=lambda r: r["ms"])
        splits = f" splits={best['num_splits']}" if "num_splits" in best else ""
        print(
            f"sweep {label}: best {best['config']}{splits} {metric}={best[metric]:.3g} "
            f"({failed} failed)"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--result-file", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device")
    parser.add_argument("--sweep", action="store_true", help="also time candidate configs")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("kernel_bench needs a CUDA device (or --smoke)")
    device = torch.device("cuda" if cuda else "cpu")
    shapes = SMOKE if args.smoke else FULL
    name = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    copy_bw = copy_bandwidth(shapes, device)
    print(f"{name}: device-to-device copy {copy_bw / 1e9:.0f} GB/s")
    decode = bench_decode(shapes, device, copy_bw)
    prefill = bench_prefill(shapes, device)
    sweep = bench_sweep(shapes, device, copy_bw) if args.sweep else None
    goal_rows = [
        r for r in decode if r["batch"] >= GOAL_MIN_BATCH and r["context"] >= GOAL_MIN_CONTEXT
    ]
    result = {
        "benchmark": "kernel_bench",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "device": name,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "settings": {
            **asdict(shapes),
            "dtype": str(shapes.dtype),
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "smoke": args.smoke,
        },
        "copy_bandwidth_gbps": copy_bw / 1e9,
        "decode": decode,
        "prefill": prefill,
        "sweep": sweep,
        "goals": {
            "decode_min_fraction_of_copy_bw": min(
                (r["fraction_of_copy_bw"] for r in goal_rows), default=None
            ),
            "decode_goal_met": bool(goal_rows)
            and all(r["fraction_of_copy_bw"] >= DECODE_GOAL for r in goal_rows),
            "prefill_min_fraction_of_sdpa": min(r["fraction_of_sdpa"] for r in prefill),
            "prefill_goal_met": all(r["fraction_of_sdpa"] >= PREFILL_GOAL for r in prefill),
        },
    }
    slug = name.lower().replace(" ", "_")
    path = args.result_file or Path(__file__).parent / "results" / f"kernel_bench_{slug}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
