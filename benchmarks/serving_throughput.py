"""How much of the engine's offline throughput `octavo serve` keeps, on the same requests.

Workload: --num-requests token-id prompts of --prompt-len random ids (random.Random(seed)),
each generating exactly --output-len tokens (greedy, EOS ignored); a length given as MIN-MAX
is drawn per request. The model is a GPT-2 of --layers x --hidden with random weights
(--load-format dummy: config.json only) and the embedded default model's tokenizer (its
vocabulary sets the model's), so the server really detokenizes every token. `--preset
gpu-speed` is the regime a GPU makes: a near-zero-compute model (1 layer, 16 wide), 256
streams of short prompts, one token per stream per step.

  1. offline  `LLM.generate` on all requests at once in this process (default torch threads).
  2. served   `octavo serve`, one run per --modes entry (MODES: the default server, streamed;
              --inprocess-engine; unstreamed; --stream-interval 8; two API servers; modes
              with the same server flags, streamed and unstreamed, share a server), all
              requests sent at once (streams ask for `stream_options.include_usage`), read by
              --client-procs processes with a raw-socket client that parses nothing but the
              usage, so the client stays light. Each client process reports its CPU time: if
              the clients used a large share of a core, the figure is client-bound.
              --before-root DIR also serves --before-modes from another checkout of Octavo
              (an older commit) with the same flags, for a before/after in one run.

Each system runs the whole workload once untimed, then --repeats times; the median run is
reported, with every run's figure. Throughput = completion tokens (from the usage events;
exactly num_requests x output_len when nothing failed) / wall time from the first request
sent to the last stream's end. The offline engine stays up, and every timed served run comes
just after a timed offline run: `kept_of_offline` is the median of the served runs' shares
of their own offline runs (a host-bound engine follows the machine's speed, which drifts
between runs seconds apart), and the offline figure the median of those offline runs.
Where the time goes, per run:
  - offline: host work per token, (wall - the model's forward and logits) / tokens, timed
    around the model's `forward` and `compute_logits`;
  - served: each server process's CPU time per token (`/proc`, Linux): the API process(es)
    and the engine core, so that a figure this machine's noise moves can still be
    attributed. --py-spy-dir DIR also samples every server process's Python stacks during
    each mode's first timed run (py-spy, raw folded stacks, one file per mode): on a GPU,
    where the core's CPU time is all of its wall time (it spins on CUDA events), that is
    what tells its work from its waiting. --timeline-ms MS samples /metrics every MS in
    each mode's first timed run (the engine's steps, running and waiting requests): whether
    the engine stepped all along or stalled (`stalled_s`), and how full it ran.

    .venv/bin/python -m benchmarks.serving_throughput --layers 6 --hidden 512
    .venv/bin/python -m benchmarks.serving_throughput --preset gpu-speed \
        --modes streamed interval8 unstreamed api2 --before-root /tmp/before

Speed is never asserted in tests; tests/benchmarks runs a tiny configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from benchmarks.processes import cpu_seconds, process_tree
from benchmarks.provenance import REPO_ROOT, git_commit, header, machine, write_result
from benchmarks.sse_client import free_port, run_clients, running_server
from benchmarks.workload import length_range
from octavo.engine.config import DTYPES
from octavo.server.server_args import DEFAULT_MODEL

# The counter of /metrics that says how many steps the engine has run.
ENGINE_STEPS_METRIC = "octavo:engine_steps_total"
# What --timeline-ms samples from /metrics: the steps run, and the requests running and
# waiting in the engine.
TIMELINE_METRICS = {
    "steps": ENGINE_STEPS_METRIC,
    "running": "octavo:num_requests_running",
    "waiting": "octavo:num_requests_waiting",
}
# The GPU memory fraction the offline engine may take, the served one getting the rest.
OFFLINE_GPU_SHARE = 0.4
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# py-spy's sampling rate, and the time it is given to attach before the clients start.
PY_SPY_RATE_HZ = 200
PY_SPY_ATTACH_S = 1.0
MODEL_NAME = "bench"
# Served configurations: `octavo serve` flags, and whether the requests stream.
MODES: dict[str, tuple[list[str], bool]] = {
    "streamed": ([], True),
    "inprocess": (["--inprocess-engine"], True),
    "unstreamed": ([], False),
    "interval8": (["--stream-interval", "8"], True),
    "api2": (["--api-server-count", "2"], True),
}
# Flag defaults a preset replaces (flags given on the command line still win).
PRESETS = {
    "gpu-speed": {
        "layers": 1, "hidden": 16, "heads": 1, "num_requests": 256,
        "prompt_len": (16, 32), "output_len": (64, 128),
    },
    # GPT-2 small on a GPU, the same short-prompt workload (run with --device cuda).
    "gpt2": {
        "layers": 12, "hidden": 768, "heads": 12, "num_requests": 256,
        "prompt_len": (16, 32), "output_len": (64, 128),
    },
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=length_range, default=(128, 128))
    parser.add_argument("--output-len", type=length_range, default=(64, 64))
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--prefill-interval", type=int,
                        help="the engine's, offline and served (default: its default)")  # fmt: skip
    parser.add_argument("--piecewise-cuda-graphs", action=argparse.BooleanOptionalAction,
                        help="the engine's, offline and served (default: its default, on "
                        "with CUDA graphs)")  # fmt: skip
    parser.add_argument("--device", default="cpu", help="the engine's device, offline and served")
    parser.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)])
    parser.add_argument("--modes", nargs="+", choices=list(MODES),
                        default=["streamed", "inprocess"])  # fmt: skip
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="extra `octavo serve` flags (last on the line)")  # fmt: skip
    parser.add_argument("--before-root", type=Path, default=None,
                        help="an older Octavo checkout to serve from too")  # fmt: skip
    parser.add_argument("--before-modes", nargs="+", choices=list(MODES),
                        default=["streamed", "unstreamed"],
                        help="the --modes the older checkout serves")  # fmt: skip
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument("--server-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="environment of the served runs only")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (median kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", type=Path, default=None)
    parser.add_argument("--py-spy-dir", type=Path, default=None,
                        help="sample server stacks in each mode's first timed run")  # fmt: skip
    parser.add_argument("--timeline-ms", type=float, default=None,
                        help="sample the engine's steps, running and waiting requests from "
                        "/metrics this often in each mode's first timed run")  # fmt: skip
    preset = parser.parse_known_args(argv)[0].preset
    if preset is not None:
        parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    if args.py_spy_dir is not None and py_spy_executable() is None:
        parser.error("--py-spy-dir needs py-spy (the dev extra) beside python or on the PATH")
    return args


def py_spy_executable() -> str | None:
    """py-spy from this interpreter's scripts folder (a virtualenv's, not on the PATH when
    its python is run by path), else from the PATH."""
    folders = [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    return shutil.which("py-spy", path=os.pathsep.join(folders))


@contextlib.contextmanager
def stack_samples(pid: int, out: Path | None) -> Iterator[None]:
    """py-spy sampling process `pid` and its descendants while the block runs, its folded
    stacks (one line per stack, with its sample count) written to `out`; nothing if None."""
    if out is None:
        yield
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    # --idle: a waiting process is sampled too (where it waits), so a core that is idle
    # most of a short run still shows up, and waiting can be told from working.
    command = [str(py_spy_executable()), "record", "--pid", str(pid), "--subprocesses",
               "--nonblocking", "--idle", "--format", "raw", "--rate", str(PY_SPY_RATE_HZ),
               "--output", str(out)]  # fmt: skip
    spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(PY_SPY_ATTACH_S)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its samples on SIGINT, not on SIGTERM
        _, errors = spy.communicate(timeout=PY_SPY_ATTACH_S * 10)
        if spy.returncode:
            print(f"py-spy failed ({spy.returncode}): {errors.strip()}", file=sys.stderr)


def write_model(folder: Path, args: argparse.Namespace) -> int:
    """config.json for a dummy-weight GPT-2 plus the default model's tokenizer; returns the
    vocabulary size (the tokenizer's)."""
    tokenizer = json.loads((DEFAULT_MODEL / "tokenizer.json").read_text())
    vocab = len(tokenizer["model"]["vocab"]) + len(tokenizer.get("added_tokens", []))
    vocab = max(vocab, max(tokenizer["model"]["vocab"].values()) + 1)
    config = {
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": args.prompt_len[1] + args.output_len[1],
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


def make_requests(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) per request, drawn from random.Random(args.seed)."""
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.num_requests):
        prompt_len, output_len = rng.randint(*args.prompt_len), rng.randint(*args.output_len)
        requests.append(([rng.randrange(vocab - 1) for _ in range(prompt_len)], output_len))
    return requests


def engine_flags(args: argparse.Namespace) -> dict:
    return {
        "load_format": "dummy",
        "device": args.device,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": max(2048, args.prompt_len[1]),
        "prefill_interval": args.prefill_interval,
        "piecewise_cuda_graphs": args.piecewise_cuda_graphs,
    }


class OfflineRuns:
    """The workload through `LLM.generate` in this process, one timed run per `run()` call
    after an untimed one at construction. The engine stays up beside the served runs, so
    that each served run is paired with an offline run just before it: a host-bound engine
    follows the machine's speed, which drifts between runs seconds apart."""

    def __init__(
        self, model: Path, requests: list[tuple[list[int], int]], args: argparse.Namespace
    ):
        # Here, not at the top: only this run loads torch; the served modes' processes and
        # api_throughput.py (which shares this module's workload) run no model in this
        # process.
        import torch

        from benchmarks.common import PhaseTimer
        from octavo.engine import LLM, SamplingParams

        # On a GPU the served engine runs beside this one and sizes its KV cache from what
        # the device has free, so this engine takes only its share.
        cuda = args.device.startswith("cuda")
        share = {"gpu_memory_utilization": OFFLINE_GPU_SHARE} if cuda else {}
        self.llm = LLM(str(model), **engine_flags(args), **share)
        self.prompts = [prompt for prompt, _ in requests]
        self.params = [
            SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
            for _, output_len in requests
        ]
        # On a GPU the forward returns before the device has run it: no host work to time.
        self.timer = None
        if not cuda:
            self.timer = PhaseTimer(torch.device(args.device))
            network = self.llm.engine.core.runner.model
            network.forward = self.timer.wrap("forward", network.forward)
            network.compute_logits = self.timer.wrap("forward", network.compute_logits)
        self.runs: list[dict] = []
        self.run()  # warm-up, untimed
        self.runs.clear()

    def run(self) -> dict:
        """One timed run of the whole workload, kept in `runs`."""
        if self.timer is not None:
            self.timer.totals.clear()
        steps = self.llm.engine.stats().num_steps
        start = time.perf_counter()
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        run = {"wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall}
        run |= steps_taken(self.llm.engine.stats().num_steps - steps, tokens)
        if self.timer is not None:
            run["host_us_per_token"] = (wall - self.timer.totals["forward"]) / tokens * 1e6
        self.runs.append(run)
        return run

    def summary(self) -> dict:
        """The median of every timed run, with each run's figures."""
        median = median_run(self.runs)
        if self.timer is not None:
            median["all_host_us_per_token"] = [r["host_us_per_token"] for r in self.runs]
        return median


def steps_taken(steps: int | None, tokens: int) -> dict:
    """A run's engine steps and generated tokens per step: how full its batches ran, which
    tells a served run's underfilled steps from its slower ones (None: a checkout whose
    engine does not count steps)."""
    return {"engine_steps": steps, "tokens_per_step": tokens / steps if steps else None}


def fill(run: dict) -> str:
    """A run's tokens per step, as the summary prints it."""
    per_step = run.get("tokens_per_step")
    return "tokens/step n/a" if per_step is None else f"{per_step:.0f} tokens/step"


def engine_steps(port: int) -> int | None:
    """The engine steps a server has run (its /metrics), or None if it does not say."""
    steps = read_metrics(port, {"steps": ENGINE_STEPS_METRIC}).get("steps")
    return None if steps is None else int(steps)


def read_metrics(port: int, names: dict[str, str]) -> dict[str, float]:
    """The values of the /metrics samples named in `names` (key -> exact sample name)."""
    wanted = {metric: key for key, metric in names.items()}
    found = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            name, _, value = line.partition(" ")
            if name in wanted:
                found[wanted[name]] = float(value)
    return found


@contextlib.contextmanager
def metrics_timeline(port: int, interval_ms: float | None) -> Iterator[list[dict]]:
    """Samples TIMELINE_METRICS every `interval_ms` from a thread while the block runs, each
    sample stamped with time.time() (the clients' clock); nothing if None."""
    samples: list[dict] = []
    if interval_ms is None:
        yield samples
        return
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval_ms / 1e3):
            samples.append({"time": time.time(), **read_metrics(port, TIMELINE_METRICS)})

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def timeline_summary(samples: list[dict], began: float, wall_s: float) -> dict:
    """A run's timeline from its first request: per sample, seconds since then and the
    steps, running and waiting requests; and `stalled_s`, the time within the run between
    samples over which the engine ran no step (it had nothing to run, or was not stepping)."""
    inside = [s for s in samples if began <= s["time"] <= began + wall_s]
    stalled = sum(
        b["time"] - a["time"] for a, b in itertools.pairwise(inside) if b["steps"] == a["steps"]
    )
    return {
        "stalled_s": stalled,
        "samples": [
            [round(s["time"] - began, 4), s["steps"], s["running"], s["waiting"]] for s in inside
        ],
        "sample_fields": ["seconds_since_first_request", "steps", "running", "waiting"],
    }


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput, with every run's throughput kept (CPUs here are
    shared and noisy)."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "all_tokens_per_s": [r["tokens_per_s"] for r in runs]}


# -- the server ----------------------------------------------------------------------------------


def bodies(requests: list[tuple[list[int], int]], stream: bool = True) -> list[bytes]:
    """The completion requests; a stream asks for its usage (it carries the token count)."""
    streaming = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    return [
        json.dumps(
            {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
                **streaming,
            }
        ).encode()
        for prompt, output_len in requests
    ]


def run_served(
    model: Path,
    requests: list[tuple[list[int], int]],
    args: argparse.Namespace,
    root: Path,
    modes: list[str],
    offline: OfflineRuns,
) -> dict[str, dict]:
    """Serves the workload in each of `modes`, which share their server flags, from one
    `octavo serve` of checkout `root`, each timed run just after an offline one; the median
    run of each mode, and the median of its runs' shares of their offline runs."""
    port = free_port()
    flags = engine_flags(args)
    cmd = [sys.executable, "-m", "octavo", "serve", "--model", str(model)]
    cmd += ["--served-model-name", MODEL_NAME, "--port", str(port), "--log-level", "warning"]
    cmd += ["--load-format", "dummy", "--device", flags["device"], "--dtype", flags["dtype"]]
    cmd += ["--max-num-seqs", str(flags["max_num_seqs"])]
    cmd += ["--max-num-batched-tokens", str(flags["max_num_batched_tokens"])]
    if args.prefill_interval is not None:  # flags older checkouts (--before-root) lack
        cmd += ["--prefill-interval", str(args.prefill_interval)]
    if args.piecewise_cuda_graphs is not None:  # a flag older checkouts lack
        cmd += ["--piecewise-cuda-graphs" if args.piecewise_cuda_graphs
                else "--no-piecewise-cuda-graphs"]  # fmt: skip
    (extra,) = {tuple(MODES[mode][0]) for mode in modes}
    cmd += ["--max-num-waiting", str(max(1024, len(requests))), *extra, *args.server_args]
    # The checkout first; a PYTHONPATH already set (packages carried to a GPU machine) stays.
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    env.update(item.split("=", 1) for item in args.server_env)
    results = {}
    with running_server(cmd, port, cwd=root, env=env) as server:
        for mode in modes:
            sent = bodies(requests, stream=MODES[mode][1])
            run_clients(port, sent)  # warm-up: the whole workload once, untimed
            runs = []
            for repeat in range(args.repeats):
                paired = offline.run()["tokens_per_s"]
                steps = engine_steps(port)
                before = process_tree_cpu(server.pid)
                samples = None
                if args.py_spy_dir is not None and repeat == 0:
                    prefix = "" if root == REPO_ROOT else "before_"
                    samples = args.py_spy_dir / f"{prefix}{mode}.txt"
                timeline_ms = args.timeline_ms if repeat == 0 else None
                with (
                    stack_samples(server.pid, samples),
                    metrics_timeline(port, timeline_ms) as timeline,
                ):
                    run = run_clients(port, sent, args.client_procs)
                if timeline_ms is not None:
                    run["timeline"] = timeline_summary(timeline, run["began"], run["wall_s"])
                after = process_tree_cpu(server.pid)
                steps_after = engine_steps(port)
                taken = None if steps is None or steps_after is None else steps_after - steps
                run |= steps_taken(taken, run["completion_tokens"])
                run["paired_offline_tokens_per_s"] = paired
                run["kept_of_offline"] = run["tokens_per_s"] / paired
                run["cpu_us_per_token"] = {
                    name: (seconds - before.get(name, 0.0)) / run["completion_tokens"] * 1e6
                    for name, seconds in after.items()
                }
                runs.append(run)
            # The first run's timeline, whichever run is the median.
            timeline = {"timeline": runs[0].pop("timeline")} if "timeline" in runs[0] else {}
            kept = [run["kept_of_offline"] for run in runs]
            results[mode] = (
                median_run(runs)
                | timeline
                | {
                    "kept_of_offline": statistics.median(kept),
                    "all_kept_of_offline": kept,
                    "command": " ".join(cmd[1:]),
                }
            )
    return results


def process_tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by process `pid` ("main": the API process, or
    the supervisor of several) and each of its descendants ("child <pid>": the engine core,
    further API processes), from /proc (Linux; empty elsewhere)."""
    used = {p: cpu_seconds(p) for p in process_tree(pid)}
    return {
        ("main" if p == pid else f"child {p}"): seconds
        for p, seconds in used.items()
        if seconds is not None
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    here = REPO_ROOT
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        vocab = write_model(model, args)
        requests = make_requests(args, vocab)
        result: dict = {
            **header("serving_throughput", machine(args.device)),
            "workload": {
                "model": f"{args.layers}x{args.hidden} GPT-2, vocab {vocab}, dummy weights",
                "device": args.device,
                "dtype": args.dtype,
                "preset": args.preset,
                "num_requests": args.num_requests,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "client_procs": args.client_procs,
                "prefill_interval": args.prefill_interval,
                "piecewise_cuda_graphs": args.piecewise_cuda_graphs,
            },
            "served": {},
        }
        offline = OfflineRuns(model, requests, args)
        runs = [(mode, here, mode) for mode in args.modes]
        if args.before_root is not None:
            before = f"before@{git_commit(args.before_root)}"
            runs += [(f"{before} {mode}", args.before_root, mode) for mode in args.before_modes]
        # One server per checkout and set of server flags, in the order first asked for.
        servers: dict[tuple[Path, tuple[str, ...]], list[str]] = {}
        for _, root, mode in runs:
            servers.setdefault((root, tuple(MODES[mode][0])), []).append(mode)
        by_server = {
            key: run_served(model, requests, args, key[0], modes, offline)
            for key, modes in servers.items()
        }
        result["offline"] = offline.summary()
        host = result["offline"].get("host_us_per_token")
        print(
            f"offline LLM.generate: {result['offline']['tokens_per_s']:,.0f} tok/s (median of "
            f"{len(offline.runs)}, each before a served run), {fill(result['offline'])}"
            + ("" if host is None else f", host work {host:.1f} us/token")
        )
        for name, root, mode in runs:
            served = by_server[root, tuple(MODES[mode][0])][mode]
            result["served"][name] = served
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in served["cpu_us_per_token"].items())
            print(
                f"served {name}: {served['tokens_per_s']:,.0f} tok/s "
                f"({served['kept_of_offline']:.0%} of the offline run before it, median), "
                f"{fill(served)}, "
                f"failed {served['failed']}, "
                f"client CPU {served['client_cpu_share_of_a_core']:.0%} of a core; "
                f"server CPU us/token: {cpu}"
            )
    write_result(args.result_file, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
