"""Beam search: Octavo's `LLM.beam_search` (copy-on-write forking of paged KV blocks) against
Hugging Face `model.generate(num_beams=...)` (which index_selects its whole KV cache per step).

Workload (every value can be changed on the command line):
  * a GPT-2-shaped model with dummy weights (6 layers, n_embd 512, 8 heads, vocab 50257,
    n_positions 1024), written once with a fixed torch seed as a Hugging Face folder in a
    temporary directory, so both systems run the very same weights, in float32;
  * a grid of beam widths {2, 4, 8} x prompt lengths {64, 512}; per configuration 16 beam
    requests with random prompt token ids (random.Random, fixed seed; the same 16 prompts for
    every width at one prompt length), all prompts of one configuration the same length;
  * max_tokens 32, length_penalty 1.0, early_stopping False, num_return_sequences 1, EOS
    ignored (Octavo: ignore_eos=True; HF: eos_token_id=None), so every returned sequence has
    exactly max_tokens tokens (checked for both systems; a shortfall is flagged in the notes).

Systems, each timed with time.perf_counter, --repeats times (median reported, every run kept),
after one small warm-up run (excluded from the timing, as are model loading and cache set-up):
  1. octavo  `llm.beam_search(all 16 prompts, BeamSearchParams(...))`: one continuous batch.
  2. hf      `model.generate(input_ids=[16, prompt_len], num_beams=w, max_new_tokens=...,
             do_sample=False, early_stopping=False, length_penalty=1.0,
             num_return_sequences=1, eos_token_id=None)`: the 16 requests as one batch
             (same length, so no padding) -- HF's best case (--hf-batch-size to split it).
Shared CPU machines are noisy, and two torch threads on two busy cores slow down many times
over: a run whose process got less than 85% of its threads' CPU time (process_time / wall)
is marked noisy and run again (--noisy-retries); each run's CPU use and load are kept.

Metrics per configuration:
  * output tok/s  = returned tokens / wall time = 16 x max_tokens / wall (one sequence each);
  * beam tok/s    = tokens computed for all beams / wall time = 16 x width x max_tokens / wall;
    both systems share both numerators, so both ratios equal octavo tok/s / hf tok/s;
  * KV bytes copied per step, averaged over the max_tokens generation steps of the batch:
      - Octavo: the copy-on-write pairs of every engine step (`scheduler_output.blocks_to_copy`,
        recorded by a step observer of the engine core), each moving one
        block of every layer's K and V = `ModelRunner.kv_bytes_per_block(...)` bytes; total
        over the run / max_tokens (also kept: per engine step, and the largest step);
      - HF: after each of the max_tokens steps its beam search calls
        `cache.reorder_cache(beam_idx)`, an index_select over the batch x num_beams rows of
        every layer's keys and values, so the bytes moved at step s (s = 0 .. max_tokens-1)
        are computed from the shapes as
            n_layer x 2 x (batch x num_beams) x (prompt_len + s) x n_embd x element_size
        and averaged over the steps. As a cross-check the benchmark also hooks the layers'
        `reorder_cache` during the run and sums the K/V bytes it actually reorders
        (`hf.extra.observed_reorder_bytes_per_step`);
  * peak KV memory:
      - Octavo: peak over engine steps of blocks in use (num_usable_blocks - num_free_blocks,
        read in the execute wrapper, i.e. after the step's allocations) x bytes per block;
      - HF: computed from the shapes as the final cache,
            n_layer x 2 x batch x num_beams x (prompt_len + max_tokens) x n_embd x element_size
        (the transient second copy made by index_select is not counted).
  * correctness: Octavo's best beam (token ids) for the first --match-check requests of every
    configuration is compared with HF's returned sequence (reported, never fatal).

Goals from the issue, reported (not asserted): Octavo >= 3x HF beam-search throughput; and
Octavo's KV bytes copied per step <= 1/50 of HF's at prompt length 512.

Run from the repository root (the default grid takes about 4 minutes on 2 CPU cores, about
9 with --repeats 3; HF at width 8 and prompt 512 is most of it):

    .venv/bin/python -m benchmarks.beam_bench
    .venv/bin/python -m benchmarks.beam_bench --widths 4 --prompt-lens 64 --max-tokens 8

A table is printed and the JSON result is written to --result-file
(default benchmarks/results/beam_bench_cpu.json).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import GPT2LMHeadModel
from transformers.cache_utils import CacheLayerMixin

from benchmarks import common, provenance, workload
from benchmarks.common import PAD_TOKEN_ID, SystemResult, safe_div
from octavo.engine import LLM, BeamSearchParams
from octavo.engine.step_io import SchedulerOutput
from octavo.engine.worker.model_runner import ModelRunner

WARMUP_REQUESTS = 4
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 4
WARMUP_WIDTH = 2
THROUGHPUT_GOAL = 3.0  # octavo tok/s >= 3 x hf tok/s
COPY_GOAL = 50.0  # octavo bytes copied per step <= hf's / 50 ...
COPY_GOAL_PROMPT_LEN = 512  # ... at this prompt length
MIB = 1024 * 1024
NOISY_CPU_FRACTION = 0.85  # a CPU run using less than this share of its threads is noisy
# The beam search both systems run, besides the width and the length.
BEAM_SETTINGS = {"num_return_sequences": 1, "length_penalty": 1.0, "early_stopping": False}


@dataclass(frozen=True)
class Config:
    """One grid point: num_requests beam requests of prompt_len tokens, beam width `width`."""

    width: int
    prompt_len: int
    num_requests: int
    max_tokens: int

    @property
    def name(self) -> str:
        return f"w{self.width}_p{self.prompt_len}"

    @property
    def output_tokens(self) -> int:
        """Returned tokens: one sequence of max_tokens per request."""
        return self.num_requests * self.max_tokens

    @property
    def beam_tokens(self) -> int:
        """Tokens computed for all beams."""
        return self.num_requests * self.width * self.max_tokens


@dataclass
class BeamResult(SystemResult):
    """One system's timing and KV metrics on one configuration."""

    # Noise indicators per run: this process's CPU seconds / wall seconds (about the torch
    # thread count when the machine is otherwise idle, far lower when other work competes for
    # the cores) and the 1-minute load average when the run started.
    cpu_utilization_runs: list[float] = field(default_factory=list)
    load_avg_1m_runs: list[float] = field(default_factory=list)
    noisy_runs: list[bool] = field(default_factory=list)  # retried while retries are left
    output_tokens_per_s: float | None = None
    beam_tokens_per_s: float | None = None
    kv_bytes_copied_total: int | None = None
    kv_bytes_copied_per_step: float | None = None  # per generation step (max_tokens of them)
    peak_kv_bytes: int | None = None
    extra: dict = field(default_factory=dict)


# -- setup ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8], help="beam widths")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 512])
    p.add_argument("--num-requests", type=int, default=16, help="beam requests per config")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--hf-batch-size",
        type=int,
        default=16,
        help="HF runs the requests in batches of this many (default: all at once)",
    )
    common.add_model_arguments(p, "beam_bench")
    p.add_argument("--block-size", type=int, default=16, help="Octavo's KV block size")
    common.add_engine_arguments(p, repeats=1)
    p.add_argument(
        "--noisy-retries",
        type=int,
        default=4,
        help="extra runs allowed per system and config to replace noisy ones",
    )
    p.add_argument(
        "--match-check",
        type=int,
        default=4,
        help="leading requests per config whose best beams are compared with HF",
    )
    p.add_argument("--skip-hf", action="store_true")
    return common.resolve_model_arguments(p.parse_args(argv), "beam_bench")


def make_prompts(num_requests: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids (never the last id, the dummy EOS); the same for every beam width."""
    rng = random.Random(seed * 1_000_003 + prompt_len)
    return [workload.random_tokens(rng, prompt_len, vocab_size - 1) for _ in range(num_requests)]


def timed(
    result: BeamResult, fn: Callable[[], list[list[int]]], args: argparse.Namespace
) -> list[list[int]]:
    """Runs fn until `args.repeats` runs count and sets result.wall_s to their median wall
    time; returns the last run's outputs. Every run is kept with its noise indicators. On CPU
    a run whose process got less than NOISY_CPU_FRACTION of its torch threads' time was slowed
    by other work on the machine: it is marked noisy and run again (at most
    args.noisy_retries extra runs per system and config; after that noisy runs count)."""
    threads = torch.get_num_threads()
    retries_left, counted, counted_noisy, outputs = args.noisy_retries, [], False, []
    while len(counted) < args.repeats:
        result.load_avg_1m_runs.append(os.getloadavg()[0])
        cpu_start = time.process_time()
        wall, outputs = common.timed(fn, args.device)
        utilization = (time.process_time() - cpu_start) / wall
        noisy = args.device == "cpu" and utilization < NOISY_CPU_FRACTION * threads
        result.wall_s_runs.append(wall)
        result.cpu_utilization_runs.append(utilization)
        result.noisy_runs.append(noisy)
        if noisy and retries_left > 0:
            retries_left -= 1
            print(
                f"[beam_bench]   noisy run ({wall:.2f} s, cpu {utilization:.2f} of {threads} "
                "threads): running it again",
                flush=True,
            )
            continue
        counted.append(wall)
        counted_noisy = counted_noisy or noisy
    result.wall_s = statistics.median(counted)
    if counted_noisy:
        result.notes += " WARNING: noisy runs (other work on the machine) in the median."
    return outputs


def finish_timing(result: BeamResult, outputs: list[list[int]], cfg: Config) -> None:
    result.outputs = outputs
    result.output_tokens_per_s = cfg.output_tokens / result.wall_s
    result.beam_tokens_per_s = cfg.beam_tokens / result.wall_s
    bad = sum(len(o) != cfg.max_tokens for o in outputs)
    if len(outputs) != cfg.num_requests or bad:
        result.notes += (
            f" WARNING: {bad} of {len(outputs)} returned sequences do not have "
            f"exactly {cfg.max_tokens} tokens."
        )


# -- Octavo ---------------------------------------------------------------------------------


class StepRecorder:
    """A step observer of the engine core that records, per engine step, the copy-on-write
    pairs copied and the KV blocks in use."""

    def __init__(self, llm: LLM):
        self.block_manager = llm.engine.block_manager
        self.copies: list[int] = []
        self.blocks_in_use: list[int] = []
        llm.engine.core.step_observers.append(self._observe)

    def _observe(self, scheduler_output: SchedulerOutput) -> None:
        bm = self.block_manager
        self.copies.append(len(scheduler_output.blocks_to_copy))
        self.blocks_in_use.append(bm.num_usable_blocks - bm.num_free_blocks)

    def reset(self) -> None:
        self.copies.clear()
        self.blocks_in_use.clear()


def run_octavo(llm: LLM, prompts: list[list[int]], width: int, max_tokens: int) -> list[list[int]]:
    params = BeamSearchParams(
        beam_width=width, max_tokens=max_tokens, ignore_eos=True, **BEAM_SETTINGS
    )
    outs = llm.beam_search(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def bench_octavo(
    args: argparse.Namespace,
    llm: LLM,
    recorder: StepRecorder,
    cfg: Config,
    prompts: list[list[int]],
) -> BeamResult:
    result = BeamResult(
        "octavo",
        notes=(
            f"LLM.beam_search, all {cfg.num_requests} requests at once; block_size="
            f"{args.block_size}, max_num_seqs={args.max_num_seqs}, max_num_batched_tokens="
            f"{args.max_num_batched_tokens}, kv_cache_gb={args.kv_cache_gb}."
        ),
    )
    per_block = ModelRunner.kv_bytes_per_block(
        llm.engine.model_config, args.block_size, getattr(torch, args.dtype)
    )
    preempt_before = llm.engine.stats().num_preemptions

    def once() -> list[list[int]]:
        recorder.reset()  # keeps the last run's steps only
        return run_octavo(llm, prompts, cfg.width, cfg.max_tokens)

    outputs = timed(result, once, args)
    finish_timing(result, outputs, cfg)
    copies = sum(recorder.copies)
    result.kv_bytes_copied_total = copies * per_block
    result.kv_bytes_copied_per_step = copies * per_block / cfg.max_tokens
    result.peak_kv_bytes = max(recorder.blocks_in_use) * per_block
    result.extra = {
        "kv_bytes_per_block": per_block,
        "engine_steps": len(recorder.copies),
        "blocks_copied_total": copies,
        "blocks_copied_max_step": max(recorder.copies),
        "kv_bytes_copied_per_engine_step": copies * per_block / len(recorder.copies),
        "peak_blocks_in_use": max(recorder.blocks_in_use),
        "preemptions": llm.engine.stats().num_preemptions - preempt_before,
    }
    return result


# -- Hugging Face ---------------------------------------------------------------------------


@contextlib.contextmanager
def observe_hf_reorders() -> Iterator[list[int]]:
    """Hooks every cache layer's `reorder_cache` (HF's per-step beam reorder) and yields a list
    that receives the K+V bytes each call reorders; the hook reads shapes only."""
    observed: list[int] = []
    original = CacheLayerMixin.reorder_cache

    def reorder_cache(self, beam_idx):
        for t in (getattr(self, "keys", None), getattr(self, "values", None)):
            if isinstance(t, torch.Tensor):
                observed.append(t.numel() * t.element_size())
        return original(self, beam_idx)

    CacheLayerMixin.reorder_cache = reorder_cache
    try:
        yield observed
    finally:
        CacheLayerMixin.reorder_cache = original


def run_hf(
    model: GPT2LMHeadModel,
    prompts: list[list[int]],
    width: int,
    max_tokens: int,
    batch_size: int,
    device: str,
) -> list[list[int]]:
    outputs: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width_tokens = len(batch[0])
        assert all(len(p) == width_tokens for p in batch), "prompts of a batch differ in length"
        ids = torch.tensor(batch, device=device)
        with torch.inference_mode():
            generated = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                num_beams=width,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                **BEAM_SETTINGS,
                pad_token_id=PAD_TOKEN_ID,
            )
        outputs.extend(generated[:, width_tokens:].tolist())
    return outputs


def hf_bytes_per_step(cfg: Config, n_layer: int, n_embd: int, element: int) -> float:
    """Average K+V bytes HF's index_select reorders per step, from the shapes: after step s the
    cache holds prompt_len + s positions for each of the num_requests x width rows."""
    rows = cfg.num_requests * cfg.width
    total = sum(
        n_layer * 2 * rows * (cfg.prompt_len + s) * n_embd * element for s in range(cfg.max_tokens)
    )
    return total / cfg.max_tokens


def hf_peak_kv_bytes(cfg: Config, batch_size: int, n_layer: int, n_embd: int, element: int) -> int:
    """The cache of one HF batch at the end, from the shapes (index_select's copy excluded)."""
    batch = min(batch_size, cfg.num_requests)
    return n_layer * 2 * batch * cfg.width * (cfg.prompt_len + cfg.max_tokens) * n_embd * element


def bench_hf(
    args: argparse.Namespace, model: GPT2LMHeadModel, cfg: Config, prompts: list[list[int]]
) -> BeamResult:
    batch = min(args.hf_batch_size, cfg.num_requests)
    result = BeamResult(
        "hf",
        notes=(
            f"model.generate(num_beams={cfg.width}) on batches of {batch} (equal-length prompts, "
            "no padding), do_sample=False, early_stopping=False, length_penalty=1.0, "
            "num_return_sequences=1, eos_token_id=None; KV bytes and peak KV computed from the "
            "shapes (see the docstring)."
        ),
    )
    element = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    with observe_hf_reorders() as observed:
        outputs = timed(
            result,
            lambda: run_hf(model, prompts, cfg.width, cfg.max_tokens, batch, args.device),
            args,
        )
    finish_timing(result, outputs, cfg)
    per_step = hf_bytes_per_step(cfg, args.layers, args.hidden, element)
    result.kv_bytes_copied_per_step = per_step
    result.kv_bytes_copied_total = round(per_step * cfg.max_tokens)
    result.peak_kv_bytes = hf_peak_kv_bytes(cfg, batch, args.layers, args.hidden, element)
    result.extra = {
        "batch_size": batch,
        "observed_reorder_bytes_per_step": sum(observed)
        / (len(result.wall_s_runs) * cfg.max_tokens),
    }
    return result


# -- driver and reporting -------------------------------------------------------------------


def guarded(label: str, fn: Callable[[], BeamResult], name: str) -> BeamResult:
    result = common.guarded(f"[beam_bench] {label}", name, fn, BeamResult)
    if result.error is not None:
        return result
    runs = ", ".join(
        f"{w:.2f} s cpu {u:.2f}{' noisy' if n else ''}"
        for w, u, n in zip(
            result.wall_s_runs, result.cpu_utilization_runs, result.noisy_runs, strict=True
        )
    )
    print(
        f"[beam_bench] {label}: {name} median {result.wall_s:.2f} s (runs: {runs}), "
        f"{result.output_tokens_per_s:.1f} output tok/s",
        flush=True,
    )
    return result


def beam_match(octavo: BeamResult, hf: BeamResult, count: int) -> dict:
    n = min(count, len(octavo.outputs), len(hf.outputs))
    first_diff = [
        common.first_mismatch(a, b) for a, b in zip(octavo.outputs[:n], hf.outputs[:n], strict=True)
    ]
    return {
        "compared": n,
        "matched": sum(d is None for d in first_diff),
        "first_mismatch_position": first_diff,
    }


def compare(cfg: Config, octavo: BeamResult, hf: BeamResult | None, match_check: int) -> dict:
    entry: dict = {"octavo": octavo.to_json()}
    if hf is None:
        return entry
    entry["hf"] = hf.to_json()
    copy_reduction = safe_div(hf.kv_bytes_copied_per_step, octavo.kv_bytes_copied_per_step)
    entry["throughput_ratio"] = safe_div(octavo.output_tokens_per_s, hf.output_tokens_per_s)
    entry["copy_bytes_reduction"] = copy_reduction  # hf / octavo (null: octavo copied nothing)
    entry["copy_bytes_fraction"] = safe_div(
        octavo.kv_bytes_copied_per_step, hf.kv_bytes_copied_per_step
    )  # octavo / hf
    entry["peak_kv_ratio"] = safe_div(octavo.peak_kv_bytes, hf.peak_kv_bytes)  # octavo / hf
    if octavo.outputs and hf.outputs:
        entry["best_beam_match"] = beam_match(octavo, hf, match_check)
    return entry


def goals(configs: list[Config], entries: dict[str, dict]) -> dict:
    tput = {c.name: entries[c.name].get("throughput_ratio") for c in configs}
    copy = {
        c.name: entries[c.name].get("copy_bytes_fraction")
        for c in configs
        if c.prompt_len == COPY_GOAL_PROMPT_LEN
    }
    known = [r for r in tput.values() if r is not None]
    return {
        "throughput": {
            "goal": f"octavo output tok/s >= {THROUGHPUT_GOAL:g}x hf in every configuration",
            "ratios": tput,
            "geomean": math.exp(statistics.fmean(math.log(r) for r in known)) if known else None,
            "met": bool(known)
            and len(known) == len(tput)
            and all(r >= THROUGHPUT_GOAL for r in known),
        },
        "kv_copy": {
            "goal": f"octavo KV bytes copied per step <= 1/{COPY_GOAL:g} of hf's at prompt "
            f"length {COPY_GOAL_PROMPT_LEN}",
            "fractions": copy,
            # None when no configuration has that prompt length (or HF failed there)
            "met": all(f is not None and f <= 1 / COPY_GOAL for f in copy.values())
            if copy and None not in copy.values()
            else None,
        },
    }


def fmt_bytes(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:.2f}M"


def fmt_ratio(r: float | None, digits: int = 2) -> str:
    return "-" if r is None else f"{r:.{digits}f}x"


def print_table(configs: list[Config], entries: dict[str, dict]) -> None:
    header = (
        f"{'config':<10} {'oct tok/s':>10} {'hf tok/s':>9} {'ratio':>7} "
        f"{'oct B/step':>11} {'hf B/step':>10} {'hf/oct':>8} "
        f"{'oct peak KV':>12} {'hf peak KV':>11} {'match':>6}"
    )
    print(header)
    print("-" * len(header))
    for cfg in configs:
        e = entries[cfg.name]
        o, h = e["octavo"], e.get("hf")
        if o["error"] is not None:
            print(f"{cfg.name:<10} octavo ERROR: {o['error']}")
            continue
        if h is None or h["error"] is not None:
            hf_tps = hf_bytes = hf_peak = None
        else:
            hf_tps, hf_bytes, hf_peak = (
                h["output_tokens_per_s"],
                h["kv_bytes_copied_per_step"],
                h["peak_kv_bytes"],
            )
        reduction = e.get("copy_bytes_reduction")
        if reduction is None and hf_bytes and not o["kv_bytes_copied_per_step"]:
            reduction_s = "inf"
        else:
            reduction_s = fmt_ratio(reduction, 0)
        m = e.get("best_beam_match")
        match = f"{m['matched']}/{m['compared']}" if m else "-"
        print(
            f"{cfg.name:<10} {o['output_tokens_per_s']:>10.1f} "
            f"{'-' if hf_tps is None else f'{hf_tps:.1f}':>9} "
            f"{fmt_ratio(e.get('throughput_ratio')):>7} "
            f"{fmt_bytes(o['kv_bytes_copied_per_step']):>11} {fmt_bytes(hf_bytes):>10} "
            f"{reduction_s:>8} {fmt_bytes(o['peak_kv_bytes']):>12} {fmt_bytes(hf_peak):>11} "
            f"{match:>6}"
        )
    print(
        "tok/s = returned tokens (num_requests x max_tokens) / wall s; beam tok/s is width x "
        "that. B/step = KV bytes copied per generation step (M = MiB); hf/oct = how many "
        "times fewer bytes Octavo copies."
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    configs = [
        Config(w, p, args.num_requests, args.max_tokens)
        for p in args.prompt_lens
        for w in args.widths
    ]
    prompts = {
        p: make_prompts(args.num_requests, p, args.vocab, args.seed) for p in args.prompt_lens
    }
    warmup = [p[:WARMUP_PROMPT_LEN] for p in prompts[args.prompt_lens[0]][:WARMUP_REQUESTS]]
    print(
        f"[beam_bench] {len(configs)} configs x {args.num_requests} requests, max_tokens "
        f"{args.max_tokens}; torch threads {torch.get_num_threads()}",
        flush=True,
    )
    entries: dict[str, dict] = {}
    grid_start = time.perf_counter()
    with common.dummy_checkpoint(args) as folder:
        llm = common.make_llm(folder, args, block_size=args.block_size)
        recorder = StepRecorder(llm)
        run_octavo(llm, warmup, WARMUP_WIDTH, WARMUP_OUTPUT_LEN)
        hf_model = None
        if not args.skip_hf:
            hf_model = common.load_hf_model(folder, args.device, getattr(torch, args.dtype))
            run_hf(
                hf_model, warmup, WARMUP_WIDTH, WARMUP_OUTPUT_LEN, args.hf_batch_size, args.device
            )
        for cfg in configs:
            octavo = guarded(
                cfg.name,
                lambda cfg=cfg: bench_octavo(args, llm, recorder, cfg, prompts[cfg.prompt_len]),
                "octavo",
            )
            hf = None
            if hf_model is not None:
                hf = guarded(
                    cfg.name,
                    lambda cfg=cfg: bench_hf(args, hf_model, cfg, prompts[cfg.prompt_len]),
                    "hf",
                )
            entries[cfg.name] = compare(cfg, octavo, hf, args.match_check)
    grid_s = time.perf_counter() - grid_start

    report = {
        **common.result_header("beam_bench", args.device),
        "model": common.model_info(args),
        "settings": {
            "widths": args.widths,
            "prompt_lens": args.prompt_lens,
            "num_requests": args.num_requests,
            "max_tokens": args.max_tokens,
            **BEAM_SETTINGS,
            "eos": "ignored (octavo ignore_eos=True, hf eos_token_id=None)",
            "dtype": args.dtype,
            "seed": args.seed,
            "hf_batch_size": args.hf_batch_size,
            "octavo_block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_gb": args.kv_cache_gb,
            "timed_repeats": args.repeats,
            "noisy_retries": args.noisy_retries,
            "noisy_cpu_fraction": NOISY_CPU_FRACTION,
            "grid_wall_s": grid_s,
        },
        "results": entries,
        "goals": goals(configs, entries) if hf_model is not None else None,
        "notes": (
            "output_tokens_per_s = num_requests x max_tokens / wall s; beam_tokens_per_s = "
            "num_requests x width x max_tokens / wall s; wall s is the median of the timed "
            "repeats (all in wall_s_runs), excluding model loading and one small warm-up run "
            f"per system ({WARMUP_REQUESTS} requests, {WARMUP_PROMPT_LEN}-token prompts, width "
            f"{WARMUP_WIDTH}, {WARMUP_OUTPUT_LEN} tokens). kv_bytes_copied_per_step = total KV "
            "bytes copied over the run / max_tokens: Octavo counts its copy-on-write blocks "
            "(measured), HF's per-step index_select bytes are computed from the shapes "
            "(n_layer x 2 x rows x (prompt_len + s) x n_embd x element size, s = 0..max_tokens-1; "
            "extra.observed_reorder_bytes_per_step is the hooked cross-check). peak_kv_bytes: "
            "Octavo = peak blocks in use x bytes per block (measured); HF = final cache size "
            "of one batch from the shapes. copy_bytes_fraction = octavo / hf, "
            "copy_bytes_reduction = hf / octavo, peak_kv_ratio = octavo / hf."
        ),
    }

    print()
    print_table(configs, entries)
    if report["goals"] is not None:
        g = report["goals"]
        print(
            f"goal throughput >= {THROUGHPUT_GOAL:g}x: "
            f"{'met' if g['throughput']['met'] else 'NOT met'} "
            f"(geomean {fmt_ratio(g['throughput']['geomean'])})"
        )
        met = g["kv_copy"]["met"]
        print(
            f"goal KV copy <= 1/{COPY_GOAL:g} of hf at prompt {COPY_GOAL_PROMPT_LEN}: "
            f"{'not evaluated' if met is None else 'met' if met else 'NOT met'}"
        )
    print(f"grid took {grid_s:.0f} s")
    provenance.write_result(args.result_file, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
