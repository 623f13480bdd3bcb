"""Prefix caching: TTFT, throughput and hit rate with caching on and off, on three workloads.

Workloads (offline `LLM.generate`, greedy, EOS ignored; random token-id prompts drawn with
random.Random(workload, seed + repeat), so every timed run starts from prompts the cache has
never seen):
  shared      --num-requests requests at once, each a --shared-len-token prefix common to
              all plus --unique-len tokens of its own, --output-len new tokens each.
  multi_turn  --conversations conversations of --turns turns: each turn resends the whole
              history (the previous turn's prompt and output) plus --unique-len new tokens;
              every conversation's turn k is submitted together, after turn k - 1 ended.
  unique      --num-requests prompts of shared-len + unique-len tokens sharing nothing.

Each workload runs on one engine with enable_prefix_caching on and one with it off (same
weights, same settings otherwise), --repeats timed runs each after an untimed warm-up, the
two engines' runs alternating; the median run is reported, every run kept. TTFT is a
request's first token time minus its arrival (RequestMetrics); throughput is output tokens
/ wall time; the hit rate is prefix cache hits / queries (tokens) over the timed runs.

    .venv/bin/python -m benchmarks.prefix_caching            # the 6x512 model, on CPU

The JSON result goes to --result-file (default benchmarks/results/prefix_caching_cpu.json).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import common, provenance
from benchmarks.workload import random_tokens as tokens
from octavo.engine import LLM, RequestOutput, SamplingParams

WORKLOADS = ("shared", "multi_turn", "unique")
PERCENTILE_99 = 0.99


@dataclass
class Run:
    """One timed run of a workload: wall time, output tokens, TTFTs and cache counters."""

    wall_s: float
    output_tokens: int
    ttft_s: list[float]
    queries: int
    hits: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    common.add_model_arguments(p, "prefix_caching")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--shared-len", type=int, default=384)
    p.add_argument("--unique-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    common.add_engine_arguments(p, repeats=3)
    return common.resolve_model_arguments(p.parse_args(argv), "prefix_caching")


def run_batch(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[RequestOutput]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def run_workload(llm: LLM, workload: str, args: argparse.Namespace, seed: int) -> Run:
    """One run of `workload` on prompts drawn from `seed` (and the workload: no two
    workloads draw the same tokens); times everything but drawing."""
    rng = random.Random(f"{workload}-{seed}")
    vocab, out_len = args.vocab, args.output_len
    stats_before = llm.engine.stats()
    outputs: list[RequestOutput] = []
    start = time.perf_counter()
    if workload == "multi_turn":
        histories = [tokens(rng, args.unique_len, vocab) for _ in range(args.conversations)]
        for _ in range(args.turns):
            turn = run_batch(llm, histories, out_len)
            outputs += turn
            histories = [
                h + o.outputs[0].token_ids + tokens(rng, args.unique_len, vocab)
                for h, o in zip(histories, turn, strict=True)
            ]
    else:
        shared = tokens(rng, args.shared_len, vocab)
        prompts = [
            (shared if workload == "shared" else tokens(rng, args.shared_len, vocab))
            + tokens(rng, args.unique_len, vocab)
            for _ in range(args.num_requests)
        ]
        outputs = run_batch(llm, prompts, out_len)
    wall = time.perf_counter() - start
    stats = llm.engine.stats()
    ttft = []
    for output in outputs:
        metrics = output.metrics
        assert metrics is not None and metrics.first_token_time is not None
        ttft.append(metrics.first_token_time - metrics.arrival_time)
    return Run(
        wall_s=wall,
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        ttft_s=ttft,
        queries=stats.num_prefix_cache_queries - stats_before.num_prefix_cache_queries,
        hits=stats.num_prefix_cache_hits - stats_before.num_prefix_cache_hits,
    )


def summarize(runs: list[Run]) -> dict:
    """The median run (by wall time) and every run's figures."""
    median = sorted(runs, key=lambda r: r.wall_s)[len(runs) // 2]
    ttft = sorted(median.ttft_s)
    queries, hits = sum(r.queries for r in runs), sum(r.hits for r in runs)
    return {
        "tokens_per_s": median.tokens_per_s,
        "wall_s": median.wall_s,
        "ttft_median_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(PERCENTILE_99 * len(ttft)))],
        "hit_rate": hits / queries if queries else None,
        "runs": [
            {k: v for k, v in asdict(r).items() if k != "ttft_s"} | {"tokens_per_s": r.tokens_per_s}
            for r in runs
        ],
    }


def bench(folder: Path, args: argparse.Namespace) -> dict[str, dict[str, dict]]:
    """{"on"/"off": {workload: summary}}; the two engines' runs alternate (this machine's
    speed drifts), each run of a pair on the same prompts."""
    llms = {
        "off": common.make_llm(folder, args, enable_prefix_caching=False),
        "on": common.make_llm(folder, args, enable_prefix_caching=True),
    }
    results: dict[str, dict[str, dict]] = {"on": {}, "off": {}}
    for workload in args.workloads:
        runs: dict[str, list[Run]] = {"on": [], "off": []}
        for llm in llms.values():
            run_workload(llm, workload, args, seed=args.seed + 1000)  # warm-up, untimed
        for repeat in range(args.repeats):
            for name, llm in llms.items():
                runs[name].append(run_workload(llm, workload, args, args.seed + repeat))
        for name in llms:
            results[name][workload] = summary = summarize(runs[name])
            print(
                f"[prefix_caching] caching {name} {workload}: {summary['tokens_per_s']:.1f} "
                f"tok/s, TTFT median {summary['ttft_median_s'] * 1000:.0f} ms",
                flush=True,
            )
    return results


def ratios(on: dict, off: dict) -> dict:
    return {
        "ttft_median_off/on": off["ttft_median_s"] / on["ttft_median_s"],
        "ttft_p99_off/on": off["ttft_p99_s"] / on["ttft_p99_s"],
        "throughput_on/off": on["tokens_per_s"] / off["tokens_per_s"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with common.dummy_checkpoint(args) as folder:
        results = bench(folder, args)
    on, off = results["on"], results["off"]
    compared = {w: ratios(on[w], off[w]) for w in args.workloads}
    report = {
        **common.result_header("prefix_caching", args.device),
        "model": common.model_info(args),
        "workload": {
            k: getattr(args, k)
            for k in (
                "num_requests",
                "max_num_seqs",
                "shared_len",
                "unique_len",
                "output_len",
                "conversations",
                "turns",
                "max_num_batched_tokens",
                "kv_cache_gb",
                "repeats",
                "seed",
                "dtype",
            )
        },  # fmt: skip
        "caching_on": on,
        "caching_off": off,
        "ratios": compared,
        "goals": {
            "shared: median TTFT >= 4x lower": compared.get("shared", {}).get(
                "ttft_median_off/on", 0
            )
            >= 4,
            "shared: throughput >= 1.5x": compared.get("shared", {}).get("throughput_on/off", 0)
            >= 1.5,
            "unique: <= 2% slower": compared.get("unique", {}).get("throughput_on/off", 0) >= 0.98,
        },
    }
    for workload, r in compared.items():
        print(
            f"{workload:>10}: TTFT median {r['ttft_median_off/on']:.2f}x lower, p99 "
            f"{r['ttft_p99_off/on']:.2f}x, throughput {r['throughput_on/off']:.2f}x; hit rate "
            f"{on[workload]['hit_rate']:.2f}"
        )
    provenance.write_result(args.result_file, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
