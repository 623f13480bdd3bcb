"""How long `octavo serve` takes to start: from launching the command to /health answering
(the engine core is up and the HTTP server listens), then to the first completion.

Each run starts a fresh `octavo serve` of the model (--model, default: a 2-layer, 64-wide
GPT-2 with dummy weights and the embedded default model's tokenizer) on a free port with
--device, polls /health every --poll-ms with one cheap stdlib request, sends one 1-token
completion, and stops the server. --before-root DIR also starts another checkout of Octavo
(an older commit) with the same flags; the two alternate run by run, so drift in this
machine's speed reaches both alike. Reported per checkout: every run's seconds to ready and
to the first completion, and their medians.

    .venv/bin/python -m benchmarks.startup --runs 5 --before-root /tmp/before \\
        --result-file benchmarks/results/startup_cpu.json

Speed is never asserted in tests; tests/benchmarks runs a tiny configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.provenance import REPO_ROOT, git_commit, header, host_info, write_result
from benchmarks.sse_client import SERVER_STARTUP_TIMEOUT_S, free_port, running_server
from octavo.server.server_args import DEFAULT_MODEL

# The dummy-weight model's shape when no --model is given.
DUMMY_CONFIG = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 256}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: dummy 2x64)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=5, help="starts per checkout")
    parser.add_argument("--poll-ms", type=float, default=20.0)
    parser.add_argument("--before-root", type=Path, default=None)
    parser.add_argument("--result-file", type=Path, default=None)
    return parser.parse_args(argv)


def write_dummy_model(folder: Path) -> None:
    """config.json for dummy weights, and the default model's tokenizer (its vocabulary)."""
    folder.mkdir()
    tokenizer = (DEFAULT_MODEL / "tokenizer.json").read_text()
    parsed = json.loads(tokenizer)
    ids = [*parsed["model"]["vocab"].values(), *(t["id"] for t in parsed.get("added_tokens", []))]
    vocab = max(ids) + 1
    (folder / "config.json").write_text(json.dumps(DUMMY_CONFIG | {"vocab_size": vocab}))
    (folder / "tokenizer.json").write_text(tokenizer)


def start_once(root: Path, cmd: list[str], port: int, poll_s: float) -> dict:
    """One start of `cmd` from checkout `root`: seconds to /health, then to one completion."""
    env = dict(os.environ, PYTHONPATH=str(root))
    body = json.dumps({"model": "bench", "prompt": "The", "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    began = time.perf_counter()
    with running_server(cmd, port, poll_s, cwd=root, env=env):
        ready = time.perf_counter() - began
        with urllib.request.urlopen(request, timeout=SERVER_STARTUP_TIMEOUT_S) as response:
            json.load(response)
        first = time.perf_counter() - began
    return {"ready_s": ready, "first_completion_s": first}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    checkouts = {f"now@{git_commit(REPO_ROOT)}": REPO_ROOT}
    if args.before_root is not None:
        checkouts[f"before@{git_commit(args.before_root)}"] = args.before_root.resolve()
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        flags = ["--served-model-name", "bench", "--device", args.device, "--log-level", "warning"]
        if model is None:
            model = str(Path(tmp) / "model")
            write_dummy_model(Path(model))
            flags += ["--load-format", "dummy"]
        for _ in range(args.runs):
            for name, root in checkouts.items():
                port = free_port()
                cmd = [sys.executable, "-m", "octavo", "serve", "--model", model]
                cmd += [*flags, "--port", str(port)]
                run = start_once(root, cmd, port, args.poll_ms / 1000)
                runs[name].append(run)
                print(f"{name}: ready {run['ready_s']:.2f} s, "
                      f"first completion {run['first_completion_s']:.2f} s")  # fmt: skip
    result = header("startup", host_info()) | {
        "workload": {"model": args.model or f"dummy {DUMMY_CONFIG}", "device": args.device},
        "checkouts": {
            name: {
                "median_ready_s": statistics.median(r["ready_s"] for r in done),
                "median_first_completion_s": statistics.median(
                    r["first_completion_s"] for r in done
                ),
                "runs": done,
            }
            for name, done in runs.items()
        },
    }
    for name, summary in result["checkouts"].items():
        print(f"{name}: median ready {summary['median_ready_s']:.2f} s, "
              f"first completion {summary['median_first_completion_s']:.2f} s")  # fmt: skip
    write_result(args.result_file, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
