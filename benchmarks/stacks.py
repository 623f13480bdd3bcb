"""Where a process's time goes per engine step, from py-spy's raw folded stacks.

`serving_throughput.py --py-spy-dir` writes one file per served mode (every server process,
each stack led by `process PID:"command"` frames); `py-spy record --format raw -- python
benchmarks/serving_throughput.py ...` samples the benchmark's own process, whose offline
`LLM.generate` is the same engine without a server. This reads such a file and reports, for
the process holding the engine loop (--root: the engine core's busy loop, or `LLMEngine.step`
offline), the milliseconds per step spent under each of --phases: the samples whose stack
holds the phase's frame, over the sampling rate and the run's engine steps (--steps, from the
benchmark's result file). Phases overlap where one calls another.

    python -m benchmarks.stacks STACKS.txt --root run_busy_loop --steps 1720
    python -m benchmarks.stacks OFFLINE.txt --root "LLMEngine.step " --steps 5073

Only the samples under --root count: a benchmark process that also waits on served runs, or
a core sampled before its first request, adds nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

# A frame's text names function and file: "EngineCore.step (octavo/engine/core/...py:296)".
DEFAULT_PHASES = {
    "schedule": "Scheduler.schedule ",
    "launch (execute_async)": "ModelRunner.execute_async ",
    "  forward (every graph mode)": "ModelRunner._forward ",
    "    full decode graph": "DecodeGraphs.run ",
    "    piecewise graphs": "PiecewiseGraphs.forward ",
    "  Triton launch path": "JITFunction.run ",
    "  Triton compiling": "compile ",
    "apply results (update)": "Scheduler.update ",
    "  wait on the step's event": "StepFuture.result ",
    "route and send outputs": "ClientRouter.send ",
    "wait for requests (idle)": "ClientRouter.receiver.<locals>.receive ",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stacks", type=Path)
    parser.add_argument("--root", required=True, help="the frame that holds a step's work")
    parser.add_argument("--steps", type=int, required=True, help="engine steps in the run")
    parser.add_argument("--rate", type=int, default=200, help="py-spy's samples per second")
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")
    return parser.parse_args(argv)


def under_root(path: Path, root: str) -> collections.Counter[tuple[str, ...]]:
    """Each stack's frames from the first that contains `root` on, with its sample count,
    over every process in the file."""
    stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        for i, frame in enumerate(frames):
            if root in frame:
                stacks[tuple(frames[i:])] += int(count)
                break
    return stacks


def per_step_ms(
    stacks: collections.Counter[tuple[str, ...]], phases: dict[str, str], rate: int, steps: int
) -> dict[str, float]:
    """Milliseconds per step in the root and in each phase."""
    scale = 1e3 / rate / steps
    result = {"total under the root": sum(stacks.values()) * scale}
    for name, frame in phases.items():
        samples = sum(n for s, n in stacks.items() if any(frame in f for f in s))
        result[name] = samples * scale
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = per_step_ms(under_root(args.stacks, args.root), DEFAULT_PHASES, args.rate, args.steps)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for name, ms in result.items():
        print(f"{ms:8.3f} ms/step  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
