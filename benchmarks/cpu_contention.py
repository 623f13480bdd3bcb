"""How much slower one busy Python thread runs while other processes keep the host busy.

The engine core is one host-bound Python thread; served, the API processes and the load's
clients run beside it on the same host. This times a fixed pure-Python workload (dict and
list work, as a scheduler step does) alone and then beside N processes that spin on other
CPUs (--busy N ...), the median of --repeats timings each. A ratio well above 1 at N well
under the CPU count means the host's CPUs share a core's execution units (SMT siblings) or
its clock: a neighbour's load slows the core's step.

    python3 -m benchmarks.cpu_contention --busy 0 1 3 7 15

Speed is never asserted in tests; tests/benchmarks runs a tiny configuration.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from pathlib import Path

from benchmarks.provenance import host_info, write_result

# Time the spinning processes are given to start before the timings.
SETTLE_S = 0.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 3, 7])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--items", type=int, default=20_000, help="the workload's size")
    parser.add_argument("--result-file", type=Path, default=None)
    return parser.parse_args(argv)


def workload(items: int) -> int:
    """Dict lookups, appends and attribute-free arithmetic over `items` entries."""
    table = {i: i * 7 for i in range(items)}
    out = []
    for i in range(items):
        value = table.get(i, 0)
        if value % 3:
            out.append(value + i)
    return len(out)


def spin(stop: multiprocessing.synchronize.Event) -> None:
    while not stop.is_set():
        sum(range(10_000))


def timed(items: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        workload(items)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    context = multiprocessing.get_context("spawn")
    rows = []
    for busy in args.busy:
        stop = context.Event()
        spinners = [context.Process(target=spin, args=(stop,)) for _ in range(busy)]
        for process in spinners:
            process.start()
        time.sleep(SETTLE_S if busy else 0)
        seconds = timed(args.items, args.repeats)
        stop.set()
        for process in spinners:
            process.join()
        rows.append({"busy_processes": busy, "median_ms": seconds * 1e3})
    alone = rows[0]["median_ms"]
    for row in rows:
        row["ratio_to_first"] = row["median_ms"] / alone
        print(f"{row['busy_processes']:3} busy: {row['median_ms']:.3f} ms "
              f"({row['ratio_to_first']:.2f}x)")  # fmt: skip
    write_result(
        args.result_file,
        {"benchmark": "cpu_contention", "machine": host_info(), "cpus": os.cpu_count(),
         "settings": {"items": args.items, "repeats": args.repeats}, "rows": rows},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
