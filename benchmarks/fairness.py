"""Clients sharing one server: time to first token and throughput per client under each
--scheduling-policy, one client flooding the server beside an interactive one.

Workload: `octavo serve` on a dummy GPT-2 (--layers 4 --hidden 256 --heads 4 by default) with
--max-num-seqs 16. The flooding client keeps --flood-concurrency (24) streams open, each a
--flood-prompt-len (192) token prompt asking --flood-output-len (64) tokens, starting a new one
as each ends: more than the engine seats, so it is always backlogged. The interactive client
sends one stream at a time, a --chat-prompt-len (48) token prompt asking --chat-output-len (16)
tokens, --chat-think-s apart. Each run measures --duration-s after --warmup-s: the tokens of
the streams that end in that window, the TTFT of those sent in it too; streams still open at
the end are closed (the server aborts them) and not counted.

Runs: the interactive client alone (its TTFT floor, under fcfs), then both clients under fcfs,
priority (the interactive client's requests carry priority -1) and fair (each client sends its
own `user`). Then two backlogged clients, both shaped as the flood, one ("heavy") with
--flood-concurrency streams and the other ("light") with --light-concurrency (12): under fcfs
each takes seats in proportion to its streams, under fair each should get half. Reported per
run and client: TTFT median and p90, completed requests, generated tokens per second; the
total tokens per second; the interactive median TTFT over its alone figure and in mean engine
steps of the run (its duration over the steps /metrics counted in it: a request arriving
mid-step waits for that step, then its own); each client's share of the tokens served
(prompt + generated). Results JSON, and a plot beside it (.png).

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
import urllib.request
from pathlib import Path

from benchmarks.common import default_result_file, dummy_checkpoint
from benchmarks.provenance import REPO_ROOT, header, machine, write_result
from benchmarks.sse_client import free_port, running_server, stream_one

MODEL_NAME = "fairness"
POLICY_RUNS = (
    ("alone", "fcfs"), ("fcfs", "fcfs"), ("priority", "priority"), ("fair", "fair"),
    ("backlogged-fcfs", "fcfs"), ("backlogged-fair", "fair"),
)  # fmt: skip


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
    parser.add_argument("--light-concurrency", type=int, default=12)
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


def clients(args: argparse.Namespace, name: str) -> list[tuple[str, int, float, int, int]]:
    """A run's clients: (name, streams at a time, pause between streams, prompt and output
    lengths)."""
    flood = (args.flood_prompt_len, args.flood_output_len)
    chat = ("chat", 1, args.chat_think_s, args.chat_prompt_len, args.chat_output_len)
    if name == "alone":
        return [chat]
    if name.startswith("backlogged"):
        return [("heavy", args.flood_concurrency, 0.0, *flood),
                ("light", args.light_concurrency, 0.0, *flood)]  # fmt: skip
    return [chat, ("flood", args.flood_concurrency, 0.0, *flood)]


def bodies(client: str, prompt_len: int, output_len: int, vocab: int, policy: str, rng):
    """Endless request bodies of one client for a run's policy."""
    extra: dict = {}
    if policy == "priority" and client == "chat":
        extra["priority"] = -1
    if policy == "fair":
        extra["user"] = client
    while True:
        prompt = [rng.randrange(vocab - 1) for _ in range(prompt_len)]
        body = {
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": output_len, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
        } | extra  # fmt: skip
        yield json.dumps(body).encode()


async def client(port, requests, concurrency, think_s, start, stop, outcomes) -> None:
    """`concurrency` streams at a time until `stop`; records (whether it was sent after
    `start`, ttft, tokens) of each stream that ended between `start` and `stop`."""

    async def one_at_a_time():
        while time.monotonic() < stop:
            sent = time.monotonic()
            tokens, ok, _, ttft, _ = await stream_one(port, next(requests))
            if not ok:
                raise RuntimeError("a stream failed")
            if start <= time.monotonic() <= stop:
                outcomes.append((sent >= start, ttft, tokens))
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
    """A client's figures: tokens over the streams that ended in the window (a backlogged
    client's requests wait long, and counting only those sent in it would leave out the
    service it got for requests sent before), TTFT over those sent in it too."""
    ttfts = sorted(o[1] for o in outcomes if o[0])
    tokens = sum(o[2] for o in outcomes)
    return {
        "requests": len(outcomes),
        "ttft_median_ms": 1000 * statistics.median(ttfts) if ttfts else None,
        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
        "generated_tokens_per_s": tokens / duration_s,
        "served_tokens": tokens + prompt_len * len(outcomes),
    }


def engine_steps(port: int) -> float:
    """The server's engine steps so far (octavo:engine_steps_total of /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("octavo:engine_steps_total "):
                return float(line.split()[1])
    raise RuntimeError("/metrics has no octavo:engine_steps_total")


def run(model: Path, args: argparse.Namespace, name: str, policy: str) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "octavo", "serve", "--model", str(model), "--served-model-name",
           MODEL_NAME, "--port", str(port), "--log-level", "warning", "--device", "cpu",
           "--dtype", "float32", "--max-num-seqs", str(args.max_num_seqs),
           "--kv-cache-gb", str(args.kv_cache_gb),
           "--scheduling-policy", policy]  # fmt: skip
    rng = random.Random(args.seed)
    specs = clients(args, name)
    outcomes: dict[str, list] = {spec[0]: [] for spec in specs}
    with running_server(cmd, port, cwd=REPO_ROOT):
        steps: list[float] = []

        async def count_steps(start: float, stop: float) -> None:
            for at in (start, stop):
                await asyncio.sleep(max(at - time.monotonic(), 0))
                steps.append(await asyncio.to_thread(engine_steps, port))

        async def main():
            start = time.monotonic() + args.warmup_s
            stop = start + args.duration_s
            await asyncio.gather(count_steps(start, stop), *(
                client(port, bodies(c, prompt_len, output_len, args.vocab, policy, rng),
                       concurrency, think_s, start, stop, outcomes[c])
                for c, concurrency, think_s, prompt_len, output_len in specs
            ))  # fmt: skip

        asyncio.run(main())
    mean_step_ms = 1000 * args.duration_s / max(steps[1] - steps[0], 1)
    result: dict = {"command": " ".join(cmd[1:]), "mean_step_ms": mean_step_ms}
    for c, _, _, prompt_len, _ in specs:
        result[c] = summary(outcomes[c], prompt_len, args.duration_s)
    if len(specs) > 1:
        served = sum(result[c]["served_tokens"] for c in outcomes)
        for c in outcomes:
            result[c]["share_of_served_tokens"] = result[c]["served_tokens"] / max(served, 1)
        result["total_generated_tokens_per_s"] = sum(
            result[c]["generated_tokens_per_s"] for c in outcomes
        )
    print(name, json.dumps(result, indent=None), flush=True)
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (ttft, share) = plt.subplots(1, 2, figsize=(12, 4))
    interactive = [n for n in runs if "chat" in runs[n]]
    medians = [runs[n]["chat"]["ttft_median_ms"] or 0 for n in interactive]
    ttft.bar(interactive, medians, color="tab:blue")
    ttft.set_ylabel("interactive client's median TTFT (ms)")
    ttft.set_yscale("log")
    colors = {"chat": "tab:blue", "flood": "tab:orange", "heavy": "tab:red", "light": "tab:green"}
    for n in (n for n in runs if n != "alone"):
        bottom = 0.0
        for c, color in colors.items():
            if c in runs[n]:
                value = runs[n][c]["share_of_served_tokens"]
                share.bar(n, value, bottom=bottom, color=color)
                bottom += value
    share.axhline(0.5, color="gray", linewidth=0.8, linestyle="--")
    share.set_ylabel("share of tokens served (prompt + generated)")
    share.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=v) for v in colors.values()],
                 labels=list(colors), fontsize="small")  # fmt: skip
    share.tick_params(axis="x", labelrotation=20)
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
        median = value["chat"]["ttft_median_ms"] if "chat" in value else None
        if median:
            value["chat_ttft_in_mean_steps"] = median / value["mean_step_ms"]
        if alone and median and name != "alone":
            value["chat_ttft_over_alone"] = median / alone
    workload = {k: v for k, v in vars(args).items() if k not in ("result_file", "runs")}
    result = {**header("fairness", machine("cpu")), "workload": workload, "runs": results}
    write_result(args.result_file, result)
    plot(result, args.result_file.with_suffix(".png"))


if __name__ == "__main__":
    main()
