"""What cpu_peers.py and the peer runners share: the standard library only, since a peer's
venv has no Octavo (a runner, started as a script, imports this file from its folder)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

# The untimed warm-up: the first prompt, this many tokens.
WARMUP_TOKENS = 4

# run(prompts, max_tokens) -> each prompt's generated token ids; prompts as the engine takes them.
Run = Callable[[list, list[int]], list]


def time_runs(
    run: Run, prompts: list, max_tokens: list[int], repeats: int
) -> tuple[list[float], list[list[int]]]:
    """run(prompts, max_tokens) -> each prompt's token ids: one untimed warm-up on the first
    prompt, then `repeats` timed runs. (wall seconds of each run, the last run's outputs)."""
    run(prompts[:1], [WARMUP_TOKENS])
    runs, outputs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = run(prompts, max_tokens)
        runs.append(time.perf_counter() - start)
    return runs, [list(o) for o in outputs]


def write_result(path: str, version: str, load_s: float, runs: list[float], outputs) -> None:
    """A runner's result, as cpu_peers.py reads it."""
    result = {"version": version, "load_s": load_s, "wall_s_runs": runs, "outputs": outputs}
    Path(path).write_text(json.dumps(result))
