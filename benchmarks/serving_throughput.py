"""How much of the engine's offline throughput `octavo serve` keeps, on the same requests.

Workload: --num-requests token-id prompts of --prompt-len random ids (random.Random(seed)),
each generating exactly --output-len tokens (greedy, EOS ignored). The model is a GPT-2 of
--layers x --hidden with random weights (--load-format dummy: config.json only) and the
embedded default model's tokenizer (its vocabulary sets the model's), so the server really
detokenizes every token.

  1. offline  `LLM.generate` on all requests at once in this process (default torch threads).
  2. served   `octavo serve` (one run per --modes entry: `multiprocess` is the default server,
              engine core in its own process; `inprocess` adds --inprocess-engine), all
              requests sent at once as streams (`stream_options.include_usage`), read by
              --client-procs processes with a raw-socket client that parses no event but the
              last usage one, so the client stays light. Each client process reports its CPU
              time: if the clients used a large share of a core, the figure is client-bound.
              --before-root DIR also serves from another checkout of Octavo (an older
              commit) with the same flags, for a before/after in one run.

Each system runs the whole workload once untimed, then --repeats times; the median run is
reported, with every run's figure. Throughput = completion tokens (from the usage events;
exactly num_requests x output_len when nothing failed) / wall time from the first request
sent to the last stream's end.

    .venv/bin/python benchmarks/serving_throughput.py --layers 6 --hidden 512
    .venv/bin/python benchmarks/serving_throughput.py --layers 1 --hidden 16 --heads 1 \
        --num-requests 256

Speed is never asserted in tests; tests/benchmarks runs a tiny configuration.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

try:
    import octavo.engine  # noqa: F401
except ImportError:  # run as a plain script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from octavo.benchmarks.common import git_commit
from octavo.benchmarks.sse_client import free_port, run_clients, running_server
from octavo.engine import LLM, SamplingParams
from octavo.server.cli import DEFAULT_MODEL

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODEL_NAME = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--modes", nargs="+", default=["multiprocess", "inprocess"])
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="extra `octavo serve` flags (last on the line)")  # fmt: skip
    parser.add_argument("--before-root", type=Path, default=None,
                        help="an older Octavo checkout to serve from too")  # fmt: skip
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument("--server-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="environment of the served runs only")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (median kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", type=Path, default=None)
    return parser.parse_args(argv)


def write_model(folder: Path, args: argparse.Namespace) -> int:
    """config.json for a dummy-weight GPT-2 plus the default model's tokenizer; returns the
    vocabulary size (the tokenizer's)."""
    tokenizer = json.loads((DEFAULT_MODEL / "tokenizer.json").read_text())
    vocab = len(tokenizer["model"]["vocab"]) + len(tokenizer.get("added_tokens", []))
    vocab = max(vocab, max(tokenizer["model"]["vocab"].values()) + 1)
    config = {
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": args.prompt_len + args.output_len,
        "n_embd": args.hidden,
        "n_layer": args.layers,
        "n_head": args.heads,
        "eos_token_id": vocab - 1,
        "bos_token_id": vocab - 1,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(DEFAULT_MODEL / "tokenizer.json", folder / "tokenizer.json")
    return vocab


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [
        [rng.randrange(vocab - 1) for _ in range(args.prompt_len)] for _ in range(args.num_requests)
    ]


def engine_flags(args: argparse.Namespace) -> dict:
    return {
        "load_format": "dummy",
        "device": "cpu",
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": max(2048, args.prompt_len),
    }


def run_offline(model: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """--repeats timed runs of the whole workload after one untimed one; the median run."""
    llm = LLM(str(model), **engine_flags(args))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    runs = []
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        runs.append({"wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall})
    return median_run(runs[1:])


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput, with every run's throughput kept (CPUs here are
    shared and noisy)."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "all_tokens_per_s": [r["tokens_per_s"] for r in runs]}


# -- the server ----------------------------------------------------------------------------------


def bodies(prompts: list[list[int]], args: argparse.Namespace) -> list[bytes]:
    """The streamed completion requests, usage included (it carries the token count)."""
    return [
        json.dumps(
            {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": args.output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        for prompt in prompts
    ]


def run_served(
    model: Path, prompts: list[list[int]], args: argparse.Namespace, root: Path, extra: list[str]
) -> dict:
    port = free_port()
    flags = engine_flags(args)
    cmd = [sys.executable, "-m", "octavo", "serve", "--model", str(model)]
    cmd += ["--served-model-name", MODEL_NAME, "--port", str(port), "--log-level", "warning"]
    cmd += ["--load-format", "dummy", "--device", "cpu"]
    cmd += ["--max-num-seqs", str(flags["max_num_seqs"])]
    cmd += ["--max-num-batched-tokens", str(flags["max_num_batched_tokens"])]
    cmd += ["--max-num-waiting", str(max(1024, len(prompts))), *extra, *args.server_args]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.update(item.split("=", 1) for item in args.server_env)
    with running_server(cmd, port, cwd=root, env=env):
        requests = bodies(prompts, args)
        run_clients(port, requests)  # warm-up: the whole workload once, untimed
        result = median_run(
            [run_clients(port, requests, args.client_procs) for _ in range(args.repeats)]
        )
    result["command"] = " ".join(cmd[1:])
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        vocab = write_model(model, args)
        prompts = make_prompts(args, vocab)
        result: dict = {
            "benchmark": "serving_throughput",
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "commit": git_commit(here),
            "workload": {
                "model": f"{args.layers}x{args.hidden} GPT-2, vocab {vocab}, dummy weights",
                "num_requests": args.num_requests,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "client_procs": args.client_procs,
            },
            "offline": run_offline(model, prompts, args),
            "served": {},
        }
        offline = result["offline"]["tokens_per_s"]
        print(f"offline LLM.generate: {offline:,.0f} tok/s")
        runs = [(mode, here, mode) for mode in args.modes]
        if args.before_root is not None:
            runs.append((f"before@{git_commit(args.before_root)}", args.before_root, "before"))
        for name, root, mode in runs:
            extra = ["--inprocess-engine"] if mode == "inprocess" else []
            served = run_served(model, prompts, args, root, extra)
            served["kept_of_offline"] = served["tokens_per_s"] / offline
            result["served"][name] = served
            print(
                f"served {name}: {served['tokens_per_s']:,.0f} tok/s "
                f"({served['kept_of_offline']:.0%} of offline), failed {served['failed']}, "
                f"client CPU {served['client_cpu_share_of_a_core']:.0%} of a core"
            )
    if args.result_file is not None:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
