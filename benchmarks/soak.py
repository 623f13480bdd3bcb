"""`octavo serve` under a steady mixed load: what it serves, what fails, and the resident
memory of every server process over time.

--clients asyncio clients (httpx, in this process) send requests back to back, each of a
kind drawn at random from --kinds (KINDS: completions and chat, streamed and not, sampled
and greedy, n 3, logprobs, stop strings, structured outputs, beam search, and streams the
client abandons after their first event), every prompt a new one. Two shapes of run:

  --duration S    all kinds mixed for S seconds; each process's growth after --warmup-s
  --per-kind N    each kind alone: --warmup-requests of it, then N more; each process's
                  growth per request over those N

--fill-requests first sends long one-token prompts until the prefix cache holds all the
blocks it can, as in a server that has run for a while: the cache's index of blocks is then
at its bound, and what grows after it is not the cache filling.

The RSS of the server and of each of its descendants is sampled every --sample-s from
/proc (Linux). With one API process (the CPU default), its one spawned child is the engine
core. After the load, /metrics must show nothing running or waiting and no KV block in use.
Results JSON (--result-file); --plot-dir adds a plot of RSS over time.

    .venv/bin/python -m benchmarks.soak --duration 150 --clients 24 \\
        --result-file benchmarks/results/soak_mixed_cpu.json --plot-dir benchmarks/results/plots_cpu
    .venv/bin/python -m benchmarks.soak --fill-requests 1300 --per-kind 1500 --clients 16 \\
        --result-file benchmarks/results/soak_per_kind_cpu.json \\
        --plot-dir benchmarks/results/plots_cpu

Memory is never asserted in tests from this script (tests/engine/test_memory.py does that
in process); tests/benchmarks runs it briefly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.processes import is_resource_tracker, process_tree, resident_bytes
from benchmarks.provenance import header, host_info, write_result
from benchmarks.sse_client import free_port, running_server

MODEL = "soak"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
# Prompts are random runs of these words: each one new, so its blocks are new content.
WORDS = (  # noqa: SIM905 -- a sentence reads better than 34 quoted words
    "the while statement loop module class function value object list dict tuple string "
    "number import return yield lambda exception error file path name scope global local "
    "attribute method instance type integer float operator expression"
).split()
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
    "required": ["name", "count"],
}
# /metrics gauges that are 0 once nothing is running, waiting or holding a KV block.
METRIC_PREFIX = "octavo:"
IDLE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
# How long aborted streams may take to reach the core once the load has stopped.
IDLE_WAIT_S = 10.0
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Kind:
    """A kind of request: its route, whether it streams (and whether the client leaves
    after the first event), and its body's own fields."""

    route: str
    fields: Callable[[random.Random], dict]
    stream: bool = False
    abandon: bool = False
    prompt_words: tuple[int, int] = (3, 24)


def _tokens(rng: random.Random) -> int:
    return rng.randint(1, 32)


KINDS: dict[str, Kind] = {
    "greedy": Kind("completions", lambda r: {"temperature": 0, "max_tokens": _tokens(r)}),
    "sampled": Kind("completions", lambda r: {"temperature": 1.0, "max_tokens": _tokens(r)}),
    "n3": Kind("completions", lambda r: {"temperature": 1.0, "n": 3, "max_tokens": _tokens(r)}),
    "logprobs": Kind(
        "completions", lambda r: {"temperature": 0, "logprobs": 2, "max_tokens": _tokens(r)}
    ),
    "stop": Kind(
        "completions",
        lambda r: {"temperature": 1.0, "stop": [".", " the"], "max_tokens": _tokens(r)},
    ),
    "guided_choice": Kind(
        "completions", lambda r: {"guided_choice": ["yes", "no", "maybe"], "max_tokens": 8}
    ),
    "guided_json": Kind("completions", lambda r: {"guided_json": JSON_SCHEMA, "max_tokens": 32}),
    "beam": Kind(
        "completions",
        lambda r: {"use_beam_search": True, "n": 2, "temperature": 0, "max_tokens": _tokens(r)},
    ),
    "streamed": Kind(
        "completions", lambda r: {"temperature": 1.0, "max_tokens": _tokens(r)}, stream=True
    ),
    "chat": Kind("chat", lambda r: {"temperature": 1.0, "max_tokens": _tokens(r)}),
    "chat_streamed": Kind(
        "chat", lambda r: {"temperature": 1.0, "n": 2, "max_tokens": _tokens(r)}, stream=True
    ),
    "abandoned": Kind(
        "completions",
        lambda r: {"temperature": 1.0, "max_tokens": 64, "ignore_eos": True},
        stream=True,
        abandon=True,
    ),
}


# What --fill-requests send: prompts just under the embedded model's 512 positions (about
# 1.05 tokens a word), each of which leaves about 30 new blocks in the prefix cache.
FILL = Kind("completions", lambda r: {"temperature": 0, "max_tokens": 1}, prompt_words=(400, 460))


def body(kind: Kind, rng: random.Random) -> dict:
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(*kind.prompt_words)))
    request: dict = {"model": MODEL, **kind.fields(rng)}
    if kind.route == "chat":
        request["messages"] = [{"role": "user", "content": prompt}]
    else:
        request["prompt"] = prompt
    if kind.stream:
        request |= {"stream": True, "stream_options": {"include_usage": True}}
    return request


async def send(http: httpx.AsyncClient, kind: Kind, request: dict) -> str:
    """One request; its outcome: "ok", "4xx", "5xx", "stream error" (an error event, or a
    stream that ended without [DONE]) or "transport" (the connection failed)."""
    url = "/v1/chat/completions" if kind.route == "chat" else "/v1/completions"
    try:
        if not kind.stream:
            response = await http.post(url, json=request)
            return "ok" if response.status_code == 200 else f"{response.status_code // 100}xx"
        async with http.stream("POST", url, json=request) as response:
            if response.status_code != 200:
                await response.aread()
                return f"{response.status_code // 100}xx"
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if kind.abandon:
                    return "ok"  # leaves mid-stream: the server must abort the request
                if line == "data: [DONE]":
                    done = True
                elif '"error"' in line and "error" in json.loads(line[6:]):
                    return "stream error"
            return "ok" if done else "stream error"
    except httpx.HTTPError:
        return "transport"


@dataclass
class Tally:
    """Outcomes by kind, and what remains of a run of a set number of requests."""

    outcomes: dict[str, Counter] = field(default_factory=dict)
    remaining: int | None = None

    def take(self) -> bool:
        if self.remaining is None:
            return True
        if self.remaining <= 0:
            return False
        self.remaining -= 1
        return True

    def add(self, kind: str, outcome: str) -> None:
        self.outcomes.setdefault(kind, Counter())[outcome] += 1


async def load(
    port: int, kinds: dict[str, Kind], clients: int, seed: int, tally: Tally, until: float | None
) -> None:
    """`clients` clients sending requests of `kinds` (by name) back to back, until `until`
    (time.monotonic()) or until the tally has none left."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=timeout
    ) as http:

        async def client(rng: random.Random) -> None:
            while (until is None or time.monotonic() < until) and tally.take():
                name = rng.choice(list(kinds))
                kind = kinds[name]
                tally.add(name, await send(http, kind, body(kind, rng)))

        await asyncio.gather(*(client(random.Random(seed * 1000 + i)) for i in range(clients)))


class MemorySampler:
    """Samples the RSS of the server's processes every `interval` seconds in a thread; each
    sample is (seconds since start, phase, {process: bytes})."""

    def __init__(self, pid: int, interval: float):
        self.pid, self.interval = pid, interval
        self.phase = "start"
        self.samples: list[tuple[float, str, dict[str, int]]] = []
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> dict[str, int]:
        """Now: each server process's RSS, by role."""
        children = [p for p in process_tree(self.pid)[1:] if not is_resource_tracker(p)]
        roles = {self.pid: "api"} | {
            p: "engine core" if len(children) == 1 else f"child {p}" for p in children
        }
        rss = {role: resident_bytes(p) for p, role in roles.items()}
        now = {role: value for role, value in rss.items() if value is not None}
        self.samples.append((time.monotonic() - self._start, self.phase, now))
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()


def metrics(port: int) -> dict[str, float]:
    """/metrics's IDLE_GAUGES."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        gauge = name.removeprefix(METRIC_PREFIX)
        if gauge in IDLE_GAUGES and gauge != name:
            values[gauge] = float(value)
    return values


def wait_idle(port: int) -> dict[str, float]:
    """The IDLE_GAUGES once all are 0, or as they are after IDLE_WAIT_S."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        values = metrics(port)
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def growth(before: dict[str, int], after: dict[str, int], requests: int | None) -> dict:
    """Each process's RSS before and after, in MB, and its growth (in KB a request when
    `requests` is given)."""
    out = {}
    for role in sorted(before.keys() & after.keys()):
        grown = after[role] - before[role]
        out[role] = {
            "before_mb": round(before[role] / 2**20, 1),
            "after_mb": round(after[role] / 2**20, 1),
            "growth_mb": round(grown / 2**20, 2),
            "growth_pct": round(100 * grown / before[role], 2),
        }
        if requests:
            out[role]["growth_kb_per_request"] = round(grown / 1024 / requests, 3)
    return out


def run_phase(
    port: int, kinds: dict[str, Kind], args, sampler: MemorySampler, name: str, seed: int, **how
) -> tuple[Tally, float]:
    """One phase of load (`how`: `seconds` or `requests`), its clients seeded from `seed`
    (a phase of its own seed sends prompts no other phase sent); its tally and wall time."""
    sampler.phase = name
    seconds, requests = how.get("seconds"), how.get("requests")
    tally = Tally(remaining=requests)
    until = None if seconds is None else time.monotonic() + seconds
    start = time.monotonic()
    asyncio.run(load(port, kinds, args.clients, seed, tally, until))
    return tally, time.monotonic() - start


def served(tally: Tally) -> dict:
    outcomes = sum(tally.outcomes.values(), Counter())
    return {
        "requests": sum(outcomes.values()),
        "outcomes": dict(outcomes),
        "by_kind": {kind: dict(c) for kind, c in sorted(tally.outcomes.items())},
    }


def fill_cache(port: int, args, sampler: MemorySampler) -> dict:
    """--fill-requests long prompts of one token each, before any other phase: the prefix
    cache then holds as many blocks as it will (its index at its bound), as in a server that
    has run for a while."""
    tally, wall = run_phase(
        port, {"fill": FILL}, args, sampler, "fill", -1 - args.seed, requests=args.fill_requests
    )
    wait_idle(port)
    return served(tally) | {"wall_s": round(wall, 1)}


def soak_mixed(port: int, args, sampler: MemorySampler) -> dict:
    seed = 2 * args.seed
    kinds = {name: KINDS[name] for name in args.kinds}
    warm, _ = run_phase(port, kinds, args, sampler, "warm-up", seed, seconds=args.warmup_s)
    before = sampler.sample()
    tally, wall = run_phase(port, kinds, args, sampler, "load", seed + 1, seconds=args.duration)
    after = sampler.sample()
    return {
        "warmup": served(warm),
        "load": served(tally) | {"wall_s": round(wall, 1)},
        "rss": growth(before, after, None),
    }


def soak_per_kind(port: int, args, sampler: MemorySampler) -> dict:
    result = {}
    for number, name in enumerate(args.kinds):
        seed, kind = 2 * (args.seed * len(KINDS) + number), {name: KINDS[name]}
        warmup = args.warmup_requests
        run_phase(port, kind, args, sampler, f"{name} warm-up", seed, requests=warmup)
        wait_idle(port)
        before = sampler.sample()
        tally, wall = run_phase(port, kind, args, sampler, name, seed + 1, requests=args.per_kind)
        wait_idle(port)
        after = sampler.sample()
        result[name] = served(tally) | {
            "wall_s": round(wall, 1),
            "rss": growth(before, after, args.per_kind),
        }
        print(f"{name}: " + ", ".join(
            f"{role} {g['growth_kb_per_request']:+.2f} KB/request"
            for role, g in result[name]["rss"].items()
        ))  # fmt: skip
    return result


def plot(samples: list[tuple[float, str, dict[str, int]]], path: Path, title: str) -> None:
    """Each process's RSS over time (above), and its change since the first sample of the
    first measured phase (below), with the phases marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [(t, phase) for i, (t, phase, _) in enumerate(samples)
              if i == 0 or samples[i - 1][1] != phase]  # fmt: skip
    unmeasured = ("start", "fill")
    measured = next((t for t, p in phases if "warm-up" not in p and p not in unmeasured), 0)
    fig, (absolute, change) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for role in sorted({role for _, _, rss in samples for role in rss}):
        points = [(t, rss[role] / 2**20) for t, _, rss in samples if role in rss]
        base = next((mb for t, mb in points if t >= measured), points[0][1])
        absolute.plot([t for t, _ in points], [mb for _, mb in points], label=role)
        change.plot([t for t, _ in points], [mb - base for _, mb in points], label=role)
    for ax in (absolute, change):
        for t, _ in phases:
            ax.axvline(t, color="grey", linewidth=0.5)
    for t, phase in phases:
        absolute.annotate(phase, (t, 1), xycoords=("data", "axes fraction"), rotation=90,
                          fontsize=7, va="top", ha="right", color="grey")  # fmt: skip
    absolute.set_ylabel("resident memory (MB)")
    absolute.set_ylim(bottom=0)
    absolute.set_title(title)
    absolute.legend()
    change.set_ylabel("change since the first measured phase (MB)")
    change.set_xlabel("seconds since the server answered /health")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument("--duration", type=float, help="seconds of mixed load after the warm-up")
    shape.add_argument("--per-kind", type=int, help="requests of each kind, alone")
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--warmup-s", type=float, default=20.0)
    parser.add_argument("--warmup-requests", type=int, default=200)
    parser.add_argument("--fill-requests", type=int, default=0,
                        help="long one-token prompts sent first, to fill the prefix cache "
                        "(1200 fill the embedded model's default 2 GiB)")  # fmt: skip
    parser.add_argument("--sample-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", type=Path, default=None)
    parser.add_argument("--plot-dir", type=Path, default=None)
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="extra `octavo serve` flags (last on the line)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    port = free_port()
    cmd = [sys.executable, "-m", "octavo", "serve", "--port", str(port), "--log-level", "warning"]
    cmd += ["--served-model-name", MODEL, "--chat-template", CHAT_TEMPLATE, *args.server_args]
    with running_server(cmd, port) as server, MemorySampler(server.pid, args.sample_s) as sampler:
        started = sampler.sample()
        filled = fill_cache(port, args, sampler) if args.fill_requests else None
        if args.duration is not None:
            measured = {"mixed": soak_mixed(port, args, sampler)}
        else:
            measured = {"per_kind": soak_per_kind(port, args, sampler)}
        sampler.phase = "idle"
        idle = wait_idle(port)
    shape = "mixed" if args.duration is not None else "per_kind"
    result = header("soak", {"device": "cpu", **host_info()}) | {
        "command": " ".join(
            ["python -m benchmarks.soak", *(argv if argv is not None else sys.argv[1:])]
        ),
        "server": " ".join(cmd[1:]),
        "clients": args.clients,
        "rss_at_start_mb": {role: round(b / 2**20, 1) for role, b in started.items()},
        "fill": filled,
        **measured,
        "after_load": idle,
        "rss_samples": [
            {
                "t": round(t, 2),
                "phase": phase,
                "mb": {r: round(b / 2**20, 1) for r, b in rss.items()},
            }
            for t, phase, rss in sampler.samples
        ],
    }
    if shape == "mixed":
        mixed = measured["mixed"]
        print(
            f"served {mixed['load']['requests']} requests in {mixed['load']['wall_s']} s "
            f"({mixed['load']['outcomes']}); RSS after the warm-up: "
            + ", ".join(
                f"{role} {g['before_mb']} -> {g['after_mb']} MB ({g['growth_pct']:+.1f}%)"
                for role, g in mixed["rss"].items()
            )  # fmt: skip
        )
    print(f"after the load: {idle}")
    if args.plot_dir is not None:
        title = f"octavo serve, {args.clients} clients, " + (
            f"mixed load {args.duration:g} s" if shape == "mixed" else f"{args.per_kind} a kind"
        )
        plot(sampler.samples, args.plot_dir / f"soak_{shape}.png", title)
    write_result(args.result_file, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
