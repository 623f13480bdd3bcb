"""Load test for any OpenAI-compatible completions server (flags follow `vllm bench serve`).

Sends --num-prompts streaming /v1/completions requests with Poisson (or gamma, --burstiness)
arrivals at --request-rate, at most --max-concurrency in flight, timestamps every SSE chunk,
and reports request/token throughput, TTFT, TPOT, ITL and end-to-end latency (mean, median,
p90, p99) and goodput under --goodput SLOs. Failed requests are listed with their reasons,
never averaged away, and make the run exit with status 1. --sweep-rates runs one pass per
rate. Results go to --result-file (JSON) and, with --plot-dir, PNG plots.

    .venv/bin/octavo bench serve --base-url http://127.0.0.1:8000 \\
        --num-prompts 200 --random-input-len 128 --random-output-len 64 --request-rate 8

The flags parse (and --help prints) with the base install; sending needs httpx and --plot-dir
matplotlib, the `bench` extra (BENCH_EXTRA).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from octavo.bench.host import host_info

if TYPE_CHECKING:  # imported where requests are sent: the flags need no bench extra
    import httpx

PERCENTILES = (50, 90, 99)
# The modules of the `bench` extra (pip install 'octavo[bench]').
BENCH_EXTRA = ("httpx", "matplotlib")


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    """One request's timeline (seconds from its own start) and outcome."""

    prompt_len: int
    output_len_requested: int
    ok: bool = False
    error: str | None = None
    output_tokens: int = 0
    ttft: float | None = None
    e2el: float | None = None
    itls: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


# -- datasets ---------------------------------------------------------------------------------


def random_dataset(args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    """Token-id prompts of random ids, lengths in [len * (1 - ratio), len * (1 + ratio)]."""

    def length(mean: int) -> int:
        low = max(1, math.floor(mean * (1 - args.random_range_ratio)))
        return rng.randint(low, max(low, math.ceil(mean * (1 + args.random_range_ratio))))

    requests = []
    for _ in range(args.num_prompts):
        prompt_len = length(args.random_input_len)
        prompt = [rng.randrange(1, args.random_vocab_size) for _ in range(prompt_len)]
        requests.append(BenchRequest(prompt, prompt_len, length(args.random_output_len)))
    return requests


def jsonl_dataset(args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    """One {"prompt": ..., "output_len": ...} object per line; output_len is optional."""
    rows = [
        json.loads(line)
        for line in Path(args.dataset_path).read_text().splitlines()
        if line.strip()
    ]
    rng.shuffle(rows)
    return [
        BenchRequest(
            r["prompt"], _approx_len(r["prompt"]), int(r.get("output_len", args.random_output_len))
        )
        for r in _cycle(rows, args.num_prompts)
    ]


def sharegpt_dataset(args: argparse.Namespace, rng: random.Random) -> list[BenchRequest]:
    """ShareGPT JSON: the first human turn is the prompt; the reply's length (words, as a
    stand-in for tokens) is the output length."""
    conversations = [
        c["conversations"]
        for c in json.loads(Path(args.dataset_path).read_text())
        if len(c.get("conversations", [])) >= 2
    ]
    rng.shuffle(conversations)
    requests = []
    for turns in _cycle(conversations, args.num_prompts):
        prompt, reply = turns[0]["value"], turns[1]["value"]
        requests.append(BenchRequest(prompt, _approx_len(prompt), max(1, len(reply.split()))))
    return requests


def _approx_len(prompt: str | list[int]) -> int:
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


def _cycle(rows: list, count: int) -> list:
    if not rows:
        raise SystemExit("the dataset has no usable rows")
    return [rows[i % len(rows)] for i in range(count)]


DATASETS = {"random": random_dataset, "jsonl": jsonl_dataset, "sharegpt": sharegpt_dataset}


# -- the client -------------------------------------------------------------------------------


async def send(
    client: httpx.AsyncClient, args: argparse.Namespace, model: str, request: BenchRequest
) -> RequestResult:
    import httpx

    result = RequestResult(request.prompt_len, request.output_len)
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    last = None
    done = False
    try:
        async with client.stream("POST", f"{args.base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {_error_message(text)}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message')}"
                    return result
                now = time.perf_counter() - start
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if result.ttft is None:
                        result.ttft = now
                    elif last is not None:
                        result.itls.append(now - last)
                    last = now
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2el = time.perf_counter() - start
    if not done:
        result.error = "stream ended without data: [DONE]"
    elif result.ttft is None:
        result.error = "no token was streamed"
    else:
        result.ok = True
    return result


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200]


async def run_pass(
    args: argparse.Namespace,
    model: str,
    requests: list[BenchRequest],
    rate: float,
    rng: random.Random,
) -> tuple[list[RequestResult], float]:
    """Sends every request at `rate` (inf: all at once); returns results and duration."""
    import httpx

    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.request_timeout)
    limits = httpx.Limits(max_connections=args.max_concurrency or len(requests))
    progress = tqdm(total=len(requests), desc=f"rate {rate}", disable=args.no_progress)

    async def one(client: httpx.AsyncClient, request: BenchRequest) -> RequestResult:
        if limit is None:
            result = await send(client, args, model, request)
        else:
            async with limit:
                result = await send(client, args, model, request)
        progress.update(1)
        return result

    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one(client, request)))
            if not math.isinf(rate):
                # Gamma arrivals with mean 1 / rate; burstiness 1 is a Poisson process.
                await asyncio.sleep(
                    rng.gammavariate(args.burstiness, 1.0 / (rate * args.burstiness))
                )
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    progress.close()
    return list(results), duration


# -- metrics ----------------------------------------------------------------------------------


def describe(values: list[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 in milliseconds (None when there is nothing to describe)."""
    if not values:
        return {"mean_ms": None, "median_ms": None, "p90_ms": None, "p99_ms": None}
    ms = sorted(v * 1e3 for v in values)
    stats: dict[str, float | None] = {"mean_ms": statistics.fmean(ms)}
    for p in PERCENTILES:
        key = "median_ms" if p == 50 else f"p{p}_ms"
        stats[key] = ms[min(len(ms) - 1, math.ceil(p / 100 * len(ms)) - 1)]
    return stats


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    good = [r for r in ok if _meets(r, slos)] if slos else ok
    return {
        "completed": len(ok),
        "failed": len(failed),
        "failure_reasons": dict(Counter(r.error for r in failed)),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "goodput": len(good) / duration if slos else None,
        "ttft": describe([r.ttft for r in ok if r.ttft is not None]),
        "tpot": describe([r.tpot for r in ok if r.tpot is not None]),
        "itl": describe([itl for r in ok for itl in r.itls]),
        "e2el": describe([r.e2el for r in ok if r.e2el is not None]),
    }


def _meets(result: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.e2el}
    return all((value := values[k]) is None or value * 1e3 <= limit for k, limit in slos.items())


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise SystemExit(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        slos[name] = float(value)
    return slos


def print_summary(rate: float, summary: dict) -> None:
    print(f"\n{'=' * 20} request rate {rate} {'=' * 20}")
    rows = [
        ("Completed requests", summary["completed"]),
        ("Failed requests", summary["failed"]),
        ("Duration (s)", f"{summary['duration_s']:.2f}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_token_throughput']:.1f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.1f}"),
    ]
    if summary["goodput"] is not None:
        rows.append(("Goodput (req/s)", f"{summary['goodput']:.2f}"))
    for name, value in rows:
        print(f"{name:<36}{value:>14}")
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat, value in summary[metric].items():
            shown = "n/a" if value is None else f"{value:.2f}"
            print(f"{metric.upper() + ' ' + stat.replace('_ms', '') + ' (ms)':<36}{shown:>14}")
    for reason, count in summary["failure_reasons"].items():
        print(f"FAILED x{count}: {reason}")


def plot(plot_dir: Path, passes: list[dict]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for metric in ("ttft", "tpot", "e2el"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for p in passes:
            values = sorted(v * 1e3 for v in p["per_request"][metric] if v is not None)
            if values:
                ax.plot(
                    values,
                    [(i + 1) / len(values) for i in range(len(values))],
                    label=f"rate {p['request_rate']}",
                )
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{metric.upper()} CDF")
        ax.legend()
        ax.grid(alpha=0.3)
        path = plot_dir / f"{metric}_cdf.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(str(path))
    if len(passes) > 1:
        rates = [p["request_rate"] for p in passes]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        left.plot(rates, [p["summary"]["output_token_throughput"] for p in passes], "o-")
        left.set_xlabel("request rate (req/s)")
        left.set_ylabel("output tokens/s")
        left.grid(alpha=0.3)
        for metric in ("ttft", "tpot"):
            for stat in ("median_ms", "p99_ms"):
                right.plot(
                    rates,
                    [p["summary"][metric][stat] for p in passes],
                    "o-",
                    label=f"{metric.upper()} {stat.removesuffix('_ms')}",
                )
        right.set_xlabel("request rate (req/s)")
        right.set_ylabel("ms")
        right.legend()
        right.grid(alpha=0.3)
        path = plot_dir / "sweep.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(str(path))
    return written


# -- entry point ------------------------------------------------------------------------------


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="octavo bench serve", add_help=add_help, description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset-name", choices=sorted(DATASETS), default="random")
    parser.add_argument("--dataset-path", default=None)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument(
        "--random-vocab-size",
        type=int,
        default=256,
        help="random prompt ids are drawn from [1, this)",
    )
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS")
    parser.add_argument("--sweep-rates", default=None, help="comma-separated request rates")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--result-file", type=Path, default=None)
    parser.add_argument("--plot-dir", type=Path, default=None)
    parser.add_argument("--no-progress", action="store_true")
    return parser


def run(args: argparse.Namespace) -> int:
    """Runs the load test described by parsed flags; 1 when any request failed."""
    if args.dataset_name != "random" and not args.dataset_path:
        raise SystemExit(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.burstiness <= 0:
        raise SystemExit("--burstiness must be > 0")
    slos = parse_goodput(args.goodput)
    model = args.model or _first_model(args)
    rates = (
        [float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates else [args.request_rate]
    )
    passes: list[dict] = []
    for rate in rates:
        rng = random.Random(args.seed)
        requests = DATASETS[args.dataset_name](args, rng)
        results, duration = asyncio.run(run_pass(args, model, requests, rate, rng))
        summary = summarize(results, duration, slos)
        print_summary(rate, summary)
        passes.append({
            "request_rate": rate if not math.isinf(rate) else "inf",
            "summary": summary,
            "per_request": {
                "ttft": [r.ttft for r in results], "tpot": [r.tpot for r in results],
                "e2el": [r.e2el for r in results],
                "output_tokens": [r.output_tokens for r in results],
                "prompt_len": [r.prompt_len for r in results],
                "output_len_requested": [r.output_len_requested for r in results],
                "error": [r.error for r in results],
            },
        })  # fmt: skip
    report = {
        "benchmark": "load_test",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": host_info(),
        "settings": {
            k: _jsonable(v) for k, v in vars(args).items() if k != "api_key" and not callable(v)
        }
        | {"model": model, "goodput_slos_ms": slos},
        "passes": passes,
    }
    if args.plot_dir:
        report["plots"] = plot(args.plot_dir, passes)
    if args.result_file:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.result_file}")
    failed = sum(p["summary"]["failed"] for p in passes)
    if failed:
        print(f"{failed} request(s) failed", file=sys.stderr)
        return 1
    return 0


def _jsonable(value):
    """Paths as strings and an infinite rate as "inf" (JSON has no Infinity)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return value


def _first_model(args: argparse.Namespace) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        data = httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=30).json()
        return data["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise SystemExit(f"cannot list models at {args.base_url}: {exc}") from exc
