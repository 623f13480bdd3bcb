"""A server's processes as /proc shows them (Linux; nothing elsewhere): the process a
benchmark started and its descendants (the engine core, further API processes), with what
each has used so far."""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which, in parentheses, may hold
    spaces): fields[0] is the state, fields[1] the parent pid."""
    return (PROC / str(pid) / "stat").read_text().rpartition(")")[2].split()


def process_tree(pid: int) -> list[int]:
    """`pid` and every live descendant of it, `pid` first, the rest in pid order; empty
    without /proc or once `pid` has exited."""
    if not PROC.is_dir():
        return []
    parents: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(_stat_fields(int(entry.name))[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
    if pid not in parents:
        return []
    tree, found = {pid}, True
    while found:
        children = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= children
        found = bool(children)
    return [pid, *sorted(tree - {pid})]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` has used; None once it has exited."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def resident_bytes(pid: int) -> int | None:
    """Process `pid`'s resident memory (RSS); None once it has exited."""
    try:
        resident_pages = int((PROC / str(pid) / "statm").read_text().split()[1])
    except OSError:
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def is_resource_tracker(pid: int) -> bool:
    """Whether `pid` is multiprocessing's resource tracker (a helper every spawning process
    starts), not a server process."""
    try:
        return b"resource_tracker" in (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False
