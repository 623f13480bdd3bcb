"""Clients sharing one server: time to first token and throughput per client under each
--scheduling-policy, one client flooding the server beside an interactive one.

Workload: `octavo serve` on a dummy GPT-2 (--layers 4 --hidden 256 --heads 4 by default) with
--max-num-seqs 16. The flooding client keeps --flood-concurrency (24) streams open, each a
--flood-prompt-len (192) token prompt asking --flood-output-len (64) tokens, starting a new one
as each ends: more than the engine seats, so it is always backlogged. The interactive client
sends one stream at a time, a --chat-prompt-len (48) token prompt asking --chat-output-len (16)
tokens, --chat-think-s apart. Each run measures --duration-s after --warmup-s; streams still
open at the end are closed (the server aborts them) and not counted.

Runs: the interactive client alone (its TTFT floor, under fcfs), then both clients under fcfs,
priority (the interactive client's requests carry priority -1) and fair (each client sends its
own `user`). Reported per run and client: TTFT median and p90, completed requests, generated
tokens per second; the total tokens per second; the interactive median TTFT over its alone
figure; each client's share of the tokens served (prompt + generated). Results JSON, and a plot
beside it (.png).

    .venv/bin/python -m benchmarks.fairness
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import default_result_file, dummy_checkpoint
from benchmarks.provenance import REPO_ROOT, header, machine, write_result
from benchmarks.sse_client import free_port, running_server, stream_one

MODEL_NAME = "fairness"
POLICY_RUNS = (("alone", "fcfs"), ("fcfs", "fcfs"), ("priority", "priority"), ("fair", "fair"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--n-positions", type=int, default=1024)
    parser.add_argument("--model-type", default="gpt2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-gb", type=float, default=0.25)
    parser.add_argument("--flood-concurrency", type=int, default=24)
    parser.add_argument("--flood-prompt-len", type=int, default=192)
    parser.add_argument("--flood-output-len", type=int, default=64)
    parser.add_argument("--chat-prompt-len", type=int, default=48)
    parser.add_argument("--chat-output-len", type=int, default=16)
    parser.add_argument("--chat-think-s", type=float, default=0.05)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--runs", nargs="+", default=[name for name, _ in POLICY_RUNS],
                        choices=[name for name, _ in POLICY_RUNS])  # fmt: skip
    parser.add_argument("--result-file", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.result_file is None:
        args.result_file = default_result_file("fairness", "cpu", None)
    return args


def bodies(args: argparse.Namespace, client: str, policy: str, rng: random.Random):
    """Endless request bodies of one client ("flood" or "chat") for a run's policy."""
    prompt_len = args.flood_prompt_len if client == "flood" else args.chat_prompt_len
    output_len = args.flood_output_len if client == "flood" else args.chat_output_len
    extra: dict = {}
    if policy == "priority" and client == "chat":
        extra["priority"] = -1
    if policy == "fair":
        extra["user"] = client
    while True:
        prompt = [rng.randrange(args.vocab - 1) for _ in range(prompt_len)]
        body = {
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": output_len, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
        } | extra  # fmt: skip
        yield json.dumps(body).encode()


async def client(port, requests, concurrency, think_s, start, stop, outcomes) -> None:
    """`concurrency` streams at a time until `stop`; records (sent, ttft, tokens) of each
    stream sent after `start` that ended before `stop`."""

    async def one_at_a_time():
        while time.monotonic() < stop:
            sent = time.monotonic()
            tokens, ok, _, ttft, _ = await stream_one(port, next(requests))
            if not ok:
                raise RuntimeError("a stream failed")
            if sent >= start and time.monotonic() <= stop:
                outcomes.append((sent, ttft, tokens))
            if think_s:
                await asyncio.sleep(think_s)

    workers = [asyncio.ensure_future(one_at_a_time()) for _ in range(concurrency)]
    done, pending = await asyncio.wait(workers, timeout=max(stop - time.monotonic(), 0) + 0.5)
    for task in pending:
        task.cancel()  # closes its connection: the server aborts the stream
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()


def summary(outcomes: list, prompt_len: int, duration_s: float) -> dict:
    ttfts = sorted(o[1] for o in outcomes)
    tokens = sum(o[2] for o in outcomes)
    return {
        "requests": len(outcomes),
        "ttft_median_ms": 1000 * statistics.median(ttfts) if ttfts else None,
        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
        "generated_tokens_per_s": tokens / duration_s,
        "served_tokens": tokens + prompt_len * len(outcomes),
    }


def run(model: Path, args: argparse.Namespace, name: str, policy: str) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "octavo", "serve", "--model", str(model), "--served-model-name",
           MODEL_NAME, "--port", str(port), "--log-level", "warning", "--device", "cpu",
           "--dtype", "float32", "--max-num-seqs", str(args.max_num_seqs),
           "--kv-cache-gb", str(args.kv_cache_gb),
           "--scheduling-policy", policy]  # fmt: skip
    rng = random.Random(args.seed)
    flood_outcomes: list = []
    chat_outcomes: list = []
    with running_server(cmd, port, cwd=REPO_ROOT):

        async def main():
            start = time.monotonic() + args.warmup_s
            stop = start + args.duration_s
            chat = client(port, bodies(args, "chat", policy, rng), 1, args.chat_think_s,
                          start, stop, chat_outcomes)  # fmt: skip
            if name == "alone":
                await chat
                return
            flood = client(port, bodies(args, "flood", policy, rng), args.flood_concurrency,
                           0.0, start, stop, flood_outcomes)  # fmt: skip
            await asyncio.gather(chat, flood)

        asyncio.run(main())
    result = {
        "command": " ".join(cmd[1:]),
        "chat": summary(chat_outcomes, args.chat_prompt_len, args.duration_s),
    }
    if name != "alone":
        result["flood"] = summary(flood_outcomes, args.flood_prompt_len, args.duration_s)
        served = [result[c]["served_tokens"] for c in ("chat", "flood")]
        for c, tokens in zip(("chat", "flood"), served, strict=True):
            result[c]["share_of_served_tokens"] = tokens / max(sum(served), 1)
        result["total_generated_tokens_per_s"] = sum(
            result[c]["generated_tokens_per_s"] for c in ("chat", "flood")
        )
    print(name, json.dumps(result, indent=None), flush=True)
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = list(runs)
    fig, (ttft, share) = plt.subplots(1, 2, figsize=(10, 4))
    medians = [runs[n]["chat"]["ttft_median_ms"] or 0 for n in names]
    ttft.bar(names, medians, color="tab:blue")
    ttft.set_ylabel("interactive client's median TTFT (ms)")
    ttft.set_yscale("log")
    shared = [n for n in names if n != "alone"]
    bottoms = [0.0] * len(shared)
    for c, color in (("chat", "tab:blue"), ("flood", "tab:orange")):
        values = [runs[n][c]["share_of_served_tokens"] for n in shared]
        share.bar(shared, values, bottom=bottoms, color=color, label=c)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    share.set_ylabel("share of tokens served (prompt + generated)")
    share.legend()
    fig.suptitle(f"fairness: {result['machine'].get('cpu_model', '')}")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs = dict(POLICY_RUNS)
    with dummy_checkpoint(args) as model:
        results = {name: run(model, args, name, runs[name]) for name in args.runs}
    alone = results.get("alone", {}).get("chat", {}).get("ttft_median_ms")
    for name, value in results.items():
        median = value["chat"]["ttft_median_ms"]
        if alone and median and name != "alone":
            value["chat_ttft_over_alone"] = median / alone
    workload = {k: v for k, v in vars(args).items() if k not in ("result_file", "runs")}
    result = {**header("fairness", machine("cpu")), "workload": workload, "runs": results}
    write_result(args.result_file, result)
    plot(result, args.result_file.with_suffix(".png"))


if __name__ == "__main__":
    main()
