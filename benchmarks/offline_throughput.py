"""Offline throughput: Octavo's `LLM.generate` against Hugging Face peers on one workload.

Workload (every value can be changed on the command line):
  * a GPT-2-shaped model with dummy weights (6 layers, n_embd 512, 8 heads, vocab 50257,
    n_positions 1024), written once with a fixed torch seed as a Hugging Face folder
    (config.json + model.safetensors) in a temporary directory, so every system runs the
    very same weights;
  * 48 requests whose prompt lengths are uniform in [16, 256] and output lengths uniform in
    [16, 128], drawn with random.Random(seed); prompt token ids are random;
  * greedy decoding, EOS ignored: every request generates exactly its own output length;
    --repetition-penalty P penalizes every request (Octavo and hf_static; HF's
    continuous batching is skipped then);
  * float32 on CPU by default (--device cuda / --dtype float16 for a GPU).

Systems, each timed with time.perf_counter on the same requests, --repeats times (median
reported, every run kept: shared CPU machines are noisy), after one small warm-up run of that
system (excluded from the timing, as are model loading and KV cache allocation):
  1. octavo     Octavo `LLM.generate`, all requests submitted at once, each with its own
                max_tokens (continuous batching).
  2. hf_static  Hugging Face `model.generate` on static batches of --batch-size requests in
                order, left padded with an attention mask, max_new_tokens = the longest output
                of the batch. Only each request's own output length counts as useful; the
                rest of the batch's generation is waste.
  3. hf_cb      Hugging Face's own continuous batching (the manager behind
                `model.generate_batch`), each request added with its own max_new_tokens.

Useful output tokens/s = sum of requested output lengths / wall time, the same numerator for
every system. Correctness is checked cheaply: Octavo's greedy tokens of the first few requests
are compared with those of hf_static (reported as "greedy_match", never fatal).

Run from the repository root:

    .venv/bin/python -m benchmarks.offline_throughput
    .venv/bin/python -m benchmarks.offline_throughput --num-requests 16 --layers 2 --skip-hf-cb

A table is printed and the JSON result is written to --result-file
(default benchmarks/results/offline_throughput_cpu.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, GPT2LMHeadModel
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.utils import WorkloadHints

from benchmarks import common, provenance, workload
from benchmarks.common import PAD_TOKEN_ID, SystemResult
from octavo.engine import LLM, SamplingParams

HF_CB_PAGE_SIZE = 256  # ContinuousBatchingConfig's default page size (tokens per block)
WARMUP_REQUESTS = 4
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 8


@dataclass(frozen=True)
class Workload:
    """The requests every system runs: prompt token ids and each request's output length."""

    prompts: list[list[int]]
    output_lens: list[int]
    repetition_penalty: float = 1.0

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class ThroughputResult(SystemResult):
    """One system's timing on the workload, in useful output tokens."""

    useful_output_tokens: int = 0
    useful_output_tokens_per_s: float | None = None
    total_tokens_processed: int = 0


# -- setup ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--batch-size", type=int, default=16, help="HF static batch size")
    common.add_model_arguments(p, "offline_throughput")
    common.add_engine_arguments(p, repeats=3)
    p.add_argument(
        "--greedy-check",
        type=int,
        default=4,
        help="how many leading requests to compare between Octavo and hf_static",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="run Octavo one step ahead or not (EngineConfig.async_scheduling; default: the "
        "engine's, on for CUDA)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="every request's repetition_penalty (1: none); skips hf_cb when set",
    )
    p.add_argument("--skip-hf-static", action="store_true")
    p.add_argument("--skip-hf-cb", action="store_true")
    return common.resolve_model_arguments(p.parse_args(argv), "offline_throughput")


def make_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> Workload:
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        prompts.append(workload.random_tokens(rng, rng.randint(*prompt_len), vocab_size))
        output_lens.append(rng.randint(*output_len))
    return Workload(prompts, output_lens)


def warmup_workload(workload: Workload) -> Workload:
    """A few short requests cut from the real ones, to pay one-off costs outside the timing."""
    n = min(WARMUP_REQUESTS, workload.num_requests)
    prompts = [p[:WARMUP_PROMPT_LEN] for p in workload.prompts[:n]]
    return Workload(prompts, [WARMUP_OUTPUT_LEN] * n, workload.repetition_penalty)


# -- the systems ----------------------------------------------------------------------------


def run_octavo(llm: LLM, workload: Workload) -> list[list[int]]:
    params = [
        SamplingParams(
            max_tokens=n,
            temperature=0.0,
            ignore_eos=True,
            repetition_penalty=workload.repetition_penalty,
        )
        for n in workload.output_lens
    ]
    outs = llm.generate(workload.prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run_hf_static(
    model: GPT2LMHeadModel, workload: Workload, batch_size: int, device: str
) -> list[list[int]]:
    """Static batches in request order, left padded; each request keeps its own length."""
    outputs: list[list[int]] = []
    for start in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[start : start + batch_size]
        lens = workload.output_lens[start : start + batch_size]
        width = max(len(p) for p in prompts)
        ids = [[PAD_TOKEN_ID] * (width - len(p)) + p for p in prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        max_new = max(lens)
        generated = model.generate(
            input_ids=torch.tensor(ids, device=device),
            attention_mask=torch.tensor(mask, device=device),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD_TOKEN_ID,
            repetition_penalty=workload.repetition_penalty,
        )
        if generated.shape[1] != width + max_new:
            raise RuntimeError(
                f"HF generate stopped early: {generated.shape[1] - width} of {max_new} new tokens"
            )
        rows = generated[:, width:].tolist()
        outputs.extend(row[:n] for row, n in zip(rows, lens, strict=True))
    return outputs


def hf_static_tokens_processed(workload: Workload, batch_size: int) -> int:
    """Prompt tokens (with padding) plus generated tokens (with waste) of the static batches."""
    total = 0
    for start in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[start : start + batch_size]
        lens = workload.output_lens[start : start + batch_size]
        total += len(prompts) * (max(len(p) for p in prompts) + max(lens))
    return total


def hf_cb_config(args: argparse.Namespace, workload: Workload) -> ContinuousBatchingConfig:
    """Sizes HF CB like Octavo: same step token budget and batch cap, and a cache that holds
    every request at once (so neither system ever preempts). HF pre-allocates an fp32 attention
    mask of max_batch_tokens x (cache tokens + max_batch_tokens) and refuses caches whose
    planned footprint exceeds its memory estimate, so it cannot take Octavo's lazily allocated
    --kv-cache-gb: the cache is sized to the workload instead (plus one spare block)."""
    blocks = sum(
        math.ceil((len(p) + n) / HF_CB_PAGE_SIZE)
        for p, n in zip(workload.prompts, workload.output_lens, strict=True)
    )
    # The field was `block_size` before transformers 5.2x (the GPU machines have 5.17).
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_field = "page_size" if "page_size" in fields else "block_size"
    return ContinuousBatchingConfig(
        **{page_field: HF_CB_PAGE_SIZE},
        num_blocks=blocks + 1,
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
    )


def run_hf_cb_requests(
    manager: ContinuousBatchingManager, workload: Workload, tag: str
) -> list[list[int]]:
    """Adds every request with its own max_new_tokens and waits for all of them."""
    ids = [f"{tag}_{i}" for i in range(workload.num_requests)]
    for request_id, prompt, n in zip(ids, workload.prompts, workload.output_lens, strict=True):
        manager.add_request(prompt, request_id=request_id, max_new_tokens=n, eos_token_id=-1)
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("HF continuous batching thread stopped unexpectedly")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"HF CB request {result.request_id} failed: {result.error}")
            done[result.request_id] = list(result.generated_tokens)
    return [done[i] for i in ids]


# -- timing and reporting -------------------------------------------------------------------


def timed(
    fn: Callable[[int], list[list[int]]], device: str, repeats: int
) -> tuple[list[float], list[list[int]]]:
    """Runs fn(repeat_index) `repeats` times; returns every wall time and the last outputs."""
    walls, outputs = [], []
    for i in range(repeats):
        wall, outputs = common.timed(lambda i=i: fn(i), device)
        walls.append(wall)
    return walls, outputs


def finish(
    result: ThroughputResult,
    walls: list[float],
    outputs: list[list[int]],
    workload: Workload,
    tokens_processed: int,
) -> ThroughputResult:
    got = [len(o) for o in outputs]
    if got != workload.output_lens:
        bad = sum(g != w for g, w in zip(got, workload.output_lens, strict=True))
        result.notes += f" WARNING: {bad} requests did not produce their exact output length."
    result.wall_s = statistics.median(walls)
    result.wall_s_runs = walls
    result.outputs = outputs
    result.useful_output_tokens = workload.output_tokens
    result.useful_output_tokens_per_s = workload.output_tokens / result.wall_s
    result.total_tokens_processed = tokens_processed
    return result


def bench_octavo(args: argparse.Namespace, folder: Path, workload: Workload) -> ThroughputResult:
    result = ThroughputResult(
        "octavo",
        notes=(
            "LLM.generate with all requests at once, per-request max_tokens, ignore_eos=True; "
            f"max_num_seqs={args.max_num_seqs}, max_num_batched_tokens="
            f"{args.max_num_batched_tokens}, kv_cache_gb={args.kv_cache_gb}, "
        ),
    )
    llm = common.make_llm(folder, args, async_scheduling=args.async_scheduling)
    result.notes += f"async_scheduling={llm.engine.config.uses_async_scheduling}."
    run_octavo(llm, warmup_workload(workload))
    walls, outputs = timed(lambda _: run_octavo(llm, workload), args.device, args.repeats)
    preemptions = llm.engine.stats().num_preemptions
    result.notes += f" Preemptions (incl. warm-up): {preemptions}."
    return finish(result, walls, outputs, workload, workload.prompt_tokens + workload.output_tokens)


def bench_hf_static(
    args: argparse.Namespace, model: GPT2LMHeadModel, workload: Workload
) -> ThroughputResult:
    result = ThroughputResult(
        "hf_static",
        notes=(
            f"model.generate on static batches of {args.batch_size} in request order, left padded "
            "with attention_mask, max_new_tokens = longest output in the batch, do_sample=False, "
            "eos_token_id=None (never stops early; checked from the output shape). "
            "total_tokens_processed counts padding and wasted tokens."
        ),
    )
    run_hf_static(model, warmup_workload(workload), args.batch_size, args.device)
    walls, outputs = timed(
        lambda _: run_hf_static(model, workload, args.batch_size, args.device),
        args.device,
        args.repeats,
    )
    return finish(
        result, walls, outputs, workload, hf_static_tokens_processed(workload, args.batch_size)
    )


def bench_hf_cb(
    args: argparse.Namespace, model: GPT2LMHeadModel, workload: Workload
) -> ThroughputResult:
    cb_config = hf_cb_config(args, workload)
    result = ThroughputResult(
        "hf_cb",
        notes=(
            "transformers continuous batching (the ContinuousBatchingManager behind "
            "model.generate_batch), attn_implementation='sdpa' on the paged cache; each request "
            "added with manager.add_request(max_new_tokens=its own length, eos_token_id=-1), so "
            "every request generates exactly its length. Manager creation, cache allocation and "
            "warm-up are outside the timing. Config: page_size="
            f"{HF_CB_PAGE_SIZE}, num_blocks={cb_config.num_blocks}, max_batch_tokens="
            f"{cb_config.max_batch_tokens}, max_requests_per_batch="
            f"{cb_config.max_requests_per_batch}."
        ),
    )
    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(workload.output_lens),
        eos_token_id=-1,
        pad_token_id=PAD_TOKEN_ID,
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in workload.prompts),
        max_generated_length=max(workload.output_lens),
        num_requests=workload.num_requests,
    )
    with model.continuous_batching_context_manager(
        generation_config=generation_config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=30,
        workload_hints=hints,
    ) as manager:
        run_hf_cb_requests(manager, warmup_workload(workload), "warmup")
        walls, outputs = timed(
            lambda i: run_hf_cb_requests(manager, workload, f"run{i}"), args.device, args.repeats
        )
    return finish(result, walls, outputs, workload, workload.prompt_tokens + workload.output_tokens)


def guarded(name: str, fn: Callable[[], ThroughputResult]) -> ThroughputResult:
    result = common.guarded("[offline_throughput]", name, fn, ThroughputResult)
    if result.error is None:
        runs = ", ".join(f"{w:.2f}" for w in result.wall_s_runs)
        print(f"[offline_throughput] {name}: median {result.wall_s:.2f} s (runs: {runs})")
    return result


def greedy_match(octavo: SystemResult, reference: SystemResult, count: int) -> dict:
    n = min(count, len(octavo.outputs), len(reference.outputs))
    first_diff = [common.first_mismatch(octavo.outputs[i], reference.outputs[i]) for i in range(n)]
    return {
        "compared": n,
        "matched": sum(d is None for d in first_diff),
        "reference": reference.name,
        "first_mismatch_position": first_diff,
    }


def ratio(a: ThroughputResult, b: ThroughputResult | None) -> float | None:
    return common.safe_div(a.useful_output_tokens_per_s, b and b.useful_output_tokens_per_s)


def print_table(results: list[ThroughputResult]) -> None:
    header = (
        f"{'system':<10} {'wall s':>9} {'useful tok':>11} {'useful tok/s':>13} {'processed':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        if r.error is not None:
            print(f"{r.name:<10} ERROR: {r.error}")
            continue
        print(
            f"{r.name:<10} {r.wall_s:>9.2f} {r.useful_output_tokens:>11} "
            f"{r.useful_output_tokens_per_s:>13.1f} {r.total_tokens_processed:>10}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    workload = make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.vocab, args.seed
    )
    workload = dataclasses.replace(workload, repetition_penalty=args.repetition_penalty)
    if args.repetition_penalty != 1.0:
        args.skip_hf_cb = True  # not wired: only greedy runs through the HF CB peer here
    print(
        f"[offline_throughput] {workload.num_requests} requests, {workload.prompt_tokens} "
        f"prompt + {workload.output_tokens} output tokens; torch threads "
        f"{torch.get_num_threads()}",
        flush=True,
    )
    results: dict[str, ThroughputResult] = {}
    with common.dummy_checkpoint(args) as folder:
        results["octavo"] = guarded("octavo", lambda: bench_octavo(args, folder, workload))
        hf_model = None
        if not (args.skip_hf_static and args.skip_hf_cb):
            hf_model = common.load_hf_model(folder, args.device, getattr(torch, args.dtype))
        if not args.skip_hf_static:
            results["hf_static"] = guarded(
                "hf_static", lambda: bench_hf_static(args, hf_model, workload)
            )
        if not args.skip_hf_cb:
            results["hf_cb"] = guarded("hf_cb", lambda: bench_hf_cb(args, hf_model, workload))

    octavo = results["octavo"]
    report = {
        **common.result_header("offline_throughput", args.device),
        "model": common.model_info(args),
        "workload": {
            "num_requests": workload.num_requests,
            "prompt_len_range": list(args.prompt_len),
            "output_len_range": list(args.output_len),
            "prompt_tokens": workload.prompt_tokens,
            "output_tokens": workload.output_tokens,
            "seed": args.seed,
            "dtype": args.dtype,
            "decoding": "greedy, EOS ignored",
            "repetition_penalty": args.repetition_penalty,
            "hf_static_batch_size": args.batch_size,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_gb": args.kv_cache_gb,
            "timed_repeats": args.repeats,
        },
        "systems": {name: r.to_json() for name, r in results.items()},
        "ratios": {
            "octavo/hf_static": ratio(octavo, results.get("hf_static")),
            "octavo/hf_cb": ratio(octavo, results.get("hf_cb")),
        },
        "notes": (
            "Useful output tokens/s = sum of each request's own output length / wall time, for "
            "every system, from the median of the timed repeats (all kept in wall_s_runs). "
            "Timings exclude model loading, KV cache allocation and one small "
            f"warm-up run ({WARMUP_REQUESTS} requests, {WARMUP_PROMPT_LEN}-token prompts, "
            f"{WARMUP_OUTPUT_LEN} new tokens) per system."
        ),
    }
    if "hf_static" in results and octavo.outputs and results["hf_static"].outputs:
        report["greedy_match"] = greedy_match(octavo, results["hf_static"], args.greedy_check)
    if "hf_cb" in results and octavo.outputs and results["hf_cb"].outputs:
        report["greedy_match_hf_cb"] = greedy_match(octavo, results["hf_cb"], args.greedy_check)

    print()
    print_table(list(results.values()))
    for key, value in report["ratios"].items():
        if value is not None:
            print(f"{key}: {value:.2f}x")
    if "greedy_match" in report:
        m = report["greedy_match"]
        print(f"greedy match vs {m['reference']}: {m['matched']}/{m['compared']}")
    provenance.write_result(args.result_file, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
