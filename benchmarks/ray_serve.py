"""Octavo through Ray Serve: throughput and TTFT with 1 and 2 replicas against `octavo serve`
alone on the same requests, and the prefix-cache hit rate of least-loaded vs prefix routing.

Every system is a server process on a free port (`octavo serve`, or `octavo serve --ray`,
which starts its own local Ray instance), one torch thread per engine. The load client is
`sse_client.py` (raw sockets, separate processes, reports its own CPU): all requests at
once, streamed, usage in the last event.

  throughput: two workloads, each server answering both. "many streams": --num-requests
              prompts of --prompt-len random token ids, --output-len tokens each (EOS
              ignored); "few fast streams": --fast-requests prompts, --fast-output-len tokens
              each, so that each stream gets tokens many times faster. --repeats timed runs
              after one untimed warm-up. Ray with 1 replica runs twice: with the default
              --stream-batching-ms and with 0 (every chunk its own message).
  routing:    --prefixes groups of --per-prefix requests sharing a --prefix-len-token prefix
              (plus 16 own tokens), on each of --routing-replicas replica counts; one request
              per group first (it computes the prefix), then the rest at once. Hit rate =
              cached prompt tokens / prompt tokens of the second wave, from
              `usage.prompt_tokens_details.cached_tokens`. Least-loaded routing computes a
              prefix once on every replica its group reaches, prefix routing once in all.

    .venv/bin/python -m benchmarks.ray_serve     # -> results/ray_serve_cpu.json
    .venv/bin/python -m benchmarks.ray_serve --smoke --result-file /tmp/r.json

--smoke: a few requests, `octavo serve` and one 2-replica prefix-routed Ray run, each with a
64 MB KV cache; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.provenance import header, host_info
from benchmarks.sse_client import free_port, run_clients, running_server
from octavo.server.ray_serve.messages import REPLICA_HEADER
from octavo.server.server_args import DEFAULT_MODEL

RESULTS_DIR = Path(__file__).resolve().parent / "results"
OWN_TOKENS = 16  # after a shared prefix, per request
VOCAB = 4096  # the embedded default model's
REPLICAS_READY_TIMEOUT_S = 60


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--fast-requests", type=int, default=8)
    p.add_argument("--fast-output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--per-prefix", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument(
        "--routing-replicas",
        type=lambda s: [int(n) for n in s.split(",")],
        default=[2, 4, 8],
        help="replica counts of the routing runs, comma-separated",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="each server's and replica's (default: octavo serve's)")  # fmt: skip
    p.add_argument("--smoke", action="store_true",
                   help="a few requests, two servers, 64 MB KV caches")  # fmt: skip
    p.add_argument("--result-file", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.num_requests, args.output_len, args.repeats = 4, 4, 1
        args.fast_requests, args.fast_output_len = 2, 8
        args.prefixes, args.per_prefix, args.prefix_len = 2, 2, 64  # the routing key's length
        args.routing_replicas = [2]
        # Each server start zeroes its whole cache: the default's would cost more than the run.
        args.kv_cache_gb = 0.0625 if args.kv_cache_gb is None else args.kv_cache_gb
    return args


def body(prompt: list[int], max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": "octavo-tiny-chat",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


def server_cmd(args: argparse.Namespace, port: int, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "octavo", "serve", "--model", args.model, "--port", str(port)]
    if args.kv_cache_gb is not None:
        cmd += ["--kv-cache-gb", str(args.kv_cache_gb)]
    return cmd + ["--device", "cpu", "--torch-threads", "1", "--log-level", "warning", *extra]


def await_replicas(port: int, replicas: int) -> None:
    """Returns once /health has been answered by `replicas` distinct replicas: the ingress's
    router learns of replicas after the app reports ready, and a prefix hashed over fewer
    replicas than the later requests see would move."""
    seen: set[str] = set()
    deadline = time.monotonic() + REPLICAS_READY_TIMEOUT_S
    while len(seen) < replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only replicas {seen} answered")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            seen.add(response.headers[REPLICA_HEADER])


def summarize(runs: list[dict]) -> dict:
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "ttft_median_s": statistics.median(r["ttft_median_s"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "client_cpu_share_of_a_core": max(r["client_cpu_share_of_a_core"] for r in runs),
        "runs": runs,
    }


def measure_throughput(args: argparse.Namespace, extra: list[str]) -> dict[str, dict]:
    """Each workload's summary on one server started with `extra`."""
    rng = random.Random(args.seed)
    workloads = {
        "many streams": (args.num_requests, args.output_len),
        "few fast streams": (args.fast_requests, args.fast_output_len),
    }
    bodies = {
        name: [
            body([rng.randrange(VOCAB) for _ in range(args.prompt_len)], n_out) for _ in range(n)
        ]
        for name, (n, n_out) in workloads.items()
    }
    port = free_port()
    results = {}
    with running_server(server_cmd(args, port, extra), port, stdout=subprocess.DEVNULL):
        for name, requests in bodies.items():
            run_clients(port, requests[: max(1, len(requests) // 4)])  # warm-up
            results[name] = summarize([run_clients(port, requests) for _ in range(args.repeats)])
    return results


def measure_routing(args: argparse.Namespace, routing: str, replicas: int) -> dict:
    rng = random.Random(args.seed + 1)
    prefixes = [
        [rng.randrange(VOCAB) for _ in range(args.prefix_len)] for _ in range(args.prefixes)
    ]
    groups = [
        [prefix + [rng.randrange(VOCAB) for _ in range(OWN_TOKENS)] for _ in range(args.per_prefix)]
        for prefix in prefixes
    ]
    port = free_port()
    # The replicas share the machine's cores; Ray only has to be able to place them.
    cpus = str(min(1.0, (os.cpu_count() or 1) / replicas))
    extra = ["--ray", "--num-replicas", str(replicas), "--routing", routing]
    extra += ["--num-cpus-per-replica", cpus]
    with running_server(server_cmd(args, port, extra), port, stdout=subprocess.DEVNULL):
        await_replicas(port, replicas)
        run_clients(port, [body(group[0], 1) for group in groups])  # each prefix computed once
        rest = [p for group in groups for p in group[1:]]
        second = run_clients(port, [body(p, 1) for p in rest])
    prompt_tokens = sum(len(p) for p in rest)
    return {
        "hit_rate": second["cached_prompt_tokens"] / prompt_tokens,
        "cached_prompt_tokens": second["cached_prompt_tokens"],
        "prompt_tokens": prompt_tokens,
        "failed": second["failed"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ray_flags = ["--ray", "--num-cpus-per-replica", "1"]
    systems = {"octavo serve": []}
    if not args.smoke:
        systems["ray, 1 replica"] = [*ray_flags, "--num-replicas", "1"]
        systems["ray, 1 replica, no stream batching"] = [
            *ray_flags,
            *("--num-replicas", "1", "--stream-batching-ms", "0"),
        ]
        systems["ray, 2 replicas"] = [*ray_flags, "--num-replicas", "2"]
    throughput = {}
    for name, extra in systems.items():
        print(f"[ray_serve] {name} ...", flush=True)
        throughput[name] = measure_throughput(args, extra)
        for workload, row in throughput[name].items():
            print(
                f"  {workload}: {row['tokens_per_s']:.1f} tok/s, "
                f"TTFT median {row['ttft_median_s'] * 1e3:.0f} ms"
            )
    routings = ["prefix"] if args.smoke else ["least-loaded", "prefix"]
    routing: dict[str, dict] = {}
    for replicas in args.routing_replicas:
        runs = routing[f"{replicas} replicas"] = {}
        for name in routings:
            print(f"[ray_serve] routing {name}, {replicas} replicas ...", flush=True)
            runs[name] = measure_routing(args, name, replicas)
            print(f"  hit rate {runs[name]['hit_rate']:.2f}")
    result = {
        **header("ray_serve", host_info()),
        "settings": {k: v for k, v in vars(args).items() if k != "result_file"},
        "throughput": throughput,
        "routing": routing,
    }
    path = args.result_file or RESULTS_DIR / "ray_serve_cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
