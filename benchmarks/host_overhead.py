"""Host work per generated token: what the engine's Python costs around a near-zero model.

Workload: a GPT-2 with near-zero compute (--layers 0 or 1, --hidden 16, --heads 1, a --vocab
of 256 by default or GPT-2's 50257) with dummy weights; --batch-sizes requests of
--prompt-len random token ids each (a length, or MIN-MAX to draw each request's: with
varied lengths some sequence enters a new KV block on every step, as in serving) generate
--output-len tokens (greedy, EOS ignored; --final-only: with outputs only at their end, as
`LLM.generate` asks), all added to one `EngineCore` at once and stepped until done. Every
engine step is timed, and inside it the phases, by wrapping the core's own objects for the
run (nothing is changed in the engine for this):

  schedule   scheduler.schedule()          forward   runner.model forward + compute_logits
  execute    launching the step - forward  update    scheduler.update()
  sample     runner.sampler(...)           (inside execute)
  outputs    step() - schedule - execute - update (building the step's outputs)

A steady decode step is one in which every one of the batch's requests received a token.
Reported per batch size, as medians over the steady steps of --repeats runs: step wall time,
forward time, host work per token = (step - forward) / batch, tokens/s = batch / step, and
the phases. --before-root DIR measures another checkout (an older commit) the same way, for
a before/after in one run: each tree then runs in a fresh process, the two alternating for
--rounds rounds, and each batch size keeps a tree's fastest round (this machine's speed
drifts by more than the difference sought, and a second process run after the first was
seen slower whichever tree it held). Speed is never asserted in tests.

    .venv/bin/python -m benchmarks.host_overhead --before-root /tmp/before
    .venv/bin/python -m benchmarks.host_overhead --layers 1 --vocab 50257
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import PhaseTimer, result_header
from benchmarks.provenance import git_commit
from benchmarks.workload import length_range
from octavo.engine.config import EngineConfig
from octavo.engine.core.engine_core import EngineCore
from octavo.engine.frontend.input_processor import InputProcessor, ProcessedPrompt
from octavo.engine.sampling_params import RequestOutputKind, SamplingParams

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16  # EngineConfig's default
PHASES = ("schedule", "execute", "forward", "sample", "update", "outputs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--prompt-len", type=length_range, default=(16, 16))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine-args", default="{}", help="JSON of extra EngineConfig fields")
    parser.add_argument("--final-only", action="store_true",
                        help="FINAL_ONLY requests, as LLM.generate makes them (outputs only "
                        "when a request ends)")  # fmt: skip
    parser.add_argument("--before-root", type=Path, default=None,
                        help="an older Octavo checkout to measure too")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --before-root: alternated rounds of both trees")  # fmt: skip
    parser.add_argument("--result-file", type=Path, default=None)
    parser.add_argument("--measure-only", action="store_true",
                        help="print results as JSON (for --before-root)")  # fmt: skip
    return parser.parse_args(argv)


def instrument(core: EngineCore, timer: PhaseTimer) -> None:
    """Wraps the core's scheduler, runner, model and sampler with timers (instance attributes
    shadow the methods for this core only)."""
    scheduler, runner = core.scheduler, core.runner
    scheduler.schedule = timer.wrap("schedule", scheduler.schedule)
    scheduler.update = timer.wrap("update", scheduler.update)
    # Checkouts before async scheduling had one blocking `execute`.
    launch = "execute_async" if hasattr(runner, "execute_async") else "execute"
    setattr(runner, launch, timer.wrap("execute", getattr(runner, launch)))
    model = runner.model
    model.forward = timer.wrap("forward", model.forward)
    model.compute_logits = timer.wrap("forward", model.compute_logits)
    runner.sampler = timer.wrap("sample", runner.sampler)


def write_model(folder: Path, args: argparse.Namespace) -> None:
    config = {
        "model_type": "gpt2",
        "vocab_size": args.vocab,
        "n_positions": max_model_len(args),
        "n_embd": args.hidden,
        "n_layer": args.layers,
        "n_head": args.heads,
        "bos_token_id": args.vocab - 1,
        "eos_token_id": args.vocab - 1,
    }
    (folder / "config.json").write_text(json.dumps(config))


def max_model_len(args: argparse.Namespace) -> int:
    """The model's positions: every request's prompt and output, and a block to spare."""
    return args.prompt_len[1] + args.output_len + BLOCK_SIZE


def run_batch(model: Path, batch: int, args: argparse.Namespace) -> list[dict[str, float]]:
    """One workload of `batch` requests; the timings of each steady decode step."""
    engine_args = json.loads(args.engine_args)
    # Room for every sequence at the model's full length (which the engine requires of the
    # cache; a 0-layer model has no KV bytes to size it by).
    blocks_per_seq = -(-max_model_len(args) // BLOCK_SIZE)
    engine_args.setdefault("num_blocks", batch * blocks_per_seq + 1)
    config = EngineConfig(
        model=str(model), load_format="dummy", device=args.device, max_num_seqs=batch,
        seed=args.seed, **engine_args,
    )  # fmt: skip
    core = EngineCore(config)
    timer = PhaseTimer(core.config.torch_device)
    instrument(core, timer)
    rng = random.Random(args.seed)
    kind = RequestOutputKind.FINAL_ONLY if args.final_only else RequestOutputKind.CUMULATIVE
    params = SamplingParams(
        temperature=0.0, max_tokens=args.output_len, ignore_eos=True, output_kind=kind
    )
    inputs = InputProcessor(None, core.limits)
    for i in range(batch):
        prompt_len = rng.randint(*args.prompt_len)
        prompt = [rng.randrange(args.vocab - 1) for _ in range(prompt_len)]
        processed = ProcessedPrompt(None, prompt)
        core.add_request(inputs.core_request(str(i), processed, params, time.monotonic()))
    steps = []
    scheduler = core.scheduler
    while core.has_unfinished_requests():
        timer.totals.clear()
        timer.sync()
        sampled = scheduler.updater.num_generation_tokens
        start = time.perf_counter()
        core.step()
        timer.sync()
        wall = time.perf_counter() - start
        # Counted by the scheduler: a FINAL_ONLY request's tokens are in no step's outputs.
        if scheduler.updater.num_generation_tokens - sampled != batch:
            continue
        phases = {p: timer.totals.get(p, 0.0) for p in PHASES}
        phases["execute"] -= phases["forward"]
        phases["outputs"] = wall - timer.totals["schedule"] - timer.totals["execute"]
        phases["outputs"] -= timer.totals["update"]
        steps.append({"step": wall, **phases})
    return steps


def measure(args: argparse.Namespace) -> dict[str, dict]:
    """Per batch size: medians over every steady step of --repeats runs (after a warm-up)."""
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp)
        write_model(model, args)
        run_batch(model, min(args.batch_sizes), args)  # warm-up: allocator, lazy imports
        for batch in args.batch_sizes:
            steps = [s for _ in range(args.repeats) for s in run_batch(model, batch, args)]
            median = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
            results[str(batch)] = {
                "steady_steps": len(steps),
                "tokens_per_s": batch / median["step"],
                "step_ms": median["step"] * 1e3,
                "forward_ms": median["forward"] * 1e3,
                "host_us_per_token": (median["step"] - median["forward"]) / batch * 1e6,
                "phases_ms": {p: median[p] * 1e3 for p in PHASES},
            }
    return results


def measure_in(root: Path, argv: list[str]) -> dict[str, dict]:
    """The measurements of checkout `root`'s `octavo` package in a fresh process, by that
    checkout's own copy of this script (whose imports match its package): that checkout
    first on the path, and -P keeps the current folder off it."""
    flags = [a for a in argv if a != "--measure-only"]
    for option in ("--before-root", "--rounds", "--result-file"):
        if option in flags:
            at = flags.index(option)
            del flags[at : at + 2]
    env = {**os.environ, "PYTHONPATH": str(root.resolve())}
    out = subprocess.run(
        [sys.executable, "-P", "-m", "benchmarks.host_overhead", *flags, "--measure-only"],
        cwd=root, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return json.loads(out.splitlines()[-1])


def fastest_rounds(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Per batch size, the round with the most tokens/s."""
    return {
        batch: max((r[batch] for r in rounds), key=lambda r: r["tokens_per_s"])
        for batch in rounds[0]
    }


def print_table(name: str, results: dict[str, dict]) -> None:
    for batch, r in results.items():
        phases = " ".join(f"{p} {v:.2f}" for p, v in r["phases_ms"].items())
        print(
            f"{name:>14} batch {batch:>4}: {r['tokens_per_s']:>9,.0f} tok/s, step "
            f"{r['step_ms']:.2f} ms, forward {r['forward_ms']:.2f} ms, host "
            f"{r['host_us_per_token']:.1f} us/token | ms: {phases}"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.measure_only:
        print(json.dumps(measure(args)))
        return 0
    here = Path(__file__).resolve().parents[1]
    result: dict = {
        **result_header("host_overhead", args.device),
        "workload": {
            "model": f"{args.layers}x{args.hidden} GPT-2, {args.heads} heads, vocab "
            f"{args.vocab}, dummy weights",
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "final_only": args.final_only,
            "engine_args": json.loads(args.engine_args),
            "repeats": args.repeats,
        },
        "systems": {},
    }  # fmt: skip
    if args.before_root is None:
        result["systems"][f"octavo@{git_commit(here)}"] = measure(args)
    else:
        result["workload"]["rounds"] = args.rounds
        trees = {
            f"octavo@{git_commit(here)}": here,
            f"before@{git_commit(args.before_root)}": args.before_root,
        }
        rounds: dict[str, list[dict[str, dict]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, root in trees.items():
                rounds[name].append(measure_in(root, argv))
        result["systems"] = {name: fastest_rounds(runs) for name, runs in rounds.items()}
    for name, systems in result["systems"].items():
        print_table(name, systems)
    if args.result_file is not None:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
