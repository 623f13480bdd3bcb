"""Decode step latency: one engine step (schedule, forward, sample) per generated token at
small batch sizes, replayed from CUDA graphs and eager, against HF `generate`'s time per token.

Workload: a GPT-2-shaped model (--preset; dummy weights written once, shared by both
systems), `batch` prompts of --prompt-len random token ids, greedy, EOS ignored.
  * octavo: an LLMEngine driven step by step. One step = perf_counter around
    `engine.step()`, which returns once the sampled tokens are on the host. The first
    --warmup-steps decode steps are dropped; the median and p90 of the rest are reported.
  * hf: `model.generate` on the same batch (no padding), max_new_tokens = min_new_tokens =
    --steps; time per token = wall time / steps (its one prefill is amortised in it).
Goal: a GPT-2 small decode step at batch 1 under 1 ms with CUDA graphs.

    .venv/bin/python -m benchmarks.step_latency --device cuda --dtype float16
    .venv/bin/python -m benchmarks.step_latency --smoke --result-file /tmp/s.json

--smoke: a 2-layer model, two batch sizes, a few steps on the CPU, to check the script; its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks import common, provenance
from octavo.engine import LLMEngine, SamplingParams

SMOKE_BATCHES, SMOKE_STEPS, SMOKE_WARMUP = (1, 2), 4, 1
KV_BLOCK_SIZE = 16  # the engine's default block size


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_preset_arguments(p)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=128, help="decode steps per run")
    p.add_argument("--warmup-steps", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="tiny model on any device")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.dtype = "smoke", "float32"
        args.batches, args.steps, args.warmup_steps = SMOKE_BATCHES, SMOKE_STEPS, SMOKE_WARMUP
    return common.resolve_preset_arguments(args, "step_latency")


def kv_blocks_needed(args: argparse.Namespace) -> int:
    """A KV cache sized to the workload (the largest batch's prompts and steps, or one
    sequence of n_positions, plus the null block) rather than to the device: a second
    engine in this process must not depend on the first one's cache being released (on an
    H100 the eager engine once found the device still full after the graph engine)."""
    per_seq = -(-(args.prompt_len + args.steps + 1) // KV_BLOCK_SIZE)
    longest = -(-args.n_positions // KV_BLOCK_SIZE)
    return max(max(args.batches) * per_seq, longest) + 1


def prompts(args: argparse.Namespace, batch: int) -> list[list[int]]:
    return common.random_prompts(batch, args.prompt_len, args.vocab, args.seed + batch)


def octavo_steps_ms(engine: LLMEngine, args: argparse.Namespace, batch: int) -> list[float]:
    """Wall time of every decode step of one run (the prefill step excluded)."""
    params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts(args, batch)):
        engine.add_request(f"b{batch}-{i}", prompt, params)
    engine.step()  # the prefill, which also samples each request's first token
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def hf_ms_per_token(model, args: argparse.Namespace, batch: int) -> float:
    ids = torch.tensor(prompts(args, batch), device=args.device)
    mask = torch.ones_like(ids)
    steps = args.steps

    def generate() -> None:
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                do_sample=False,
            )  # fmt: skip

    generate()  # warm-up
    wall, _ = common.timed(generate, args.device)
    return wall * 1e3 / steps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = ["cuda_graphs", "eager"] if args.device.startswith("cuda") else ["eager"]
    rows = []
    with common.dummy_checkpoint(args) as folder:
        hf = common.load_hf_model(folder, args.device, getattr(torch, args.dtype))
        hf_ms = {batch: hf_ms_per_token(hf, args, batch) for batch in args.batches}
        del hf
        for mode in modes:
            engine = common.make_engine(
                folder, args, max_num_seqs=max(args.batches), enforce_eager=mode == "eager",
                num_blocks=kv_blocks_needed(args),
            )  # fmt: skip
            octavo_steps_ms(engine, args, 1)  # warm-up: kernels compiled, allocator primed
            for batch in args.batches:
                times = octavo_steps_ms(engine, args, batch)[args.warmup_steps :]
                median = statistics.median(times)
                p90 = sorted(times)[int(0.9 * (len(times) - 1))]
                rows.append({
                    "mode": mode, "batch": batch, "step_ms_median": median, "step_ms_p90": p90,
                    "output_tokens_per_s": batch / (median / 1e3),
                    "hf_ms_per_token": hf_ms[batch], "speedup_vs_hf": hf_ms[batch] / median,
                })  # fmt: skip
                print(
                    f"{mode:12} batch {batch:4d}: step {median:7.3f} ms (p90 {p90:7.3f}), "
                    f"HF {hf_ms[batch]:7.3f} ms/token, {hf_ms[batch] / median:5.2f}x"
                )
            del engine
    graph_batch1 = [r for r in rows if r["mode"] == "cuda_graphs" and r["batch"] == 1]
    result = {
        **common.result_header("step_latency", args.device),
        "settings": {
            key: getattr(args, key)
            for key in (
                "preset",
                "dtype",
                "batches",
                "prompt_len",
                "steps",
                "warmup_steps",
                "seed",
                "smoke",
            )
        },  # fmt: skip
        "rows": rows,
        "goals": {
            "batch1_graph_step_ms": graph_batch1[0]["step_ms_median"] if graph_batch1 else None,
            "batch1_under_1ms": bool(graph_batch1) and graph_batch1[0]["step_ms_median"] < 1.0,
        },
    }
    provenance.write_result(args.result_file, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
