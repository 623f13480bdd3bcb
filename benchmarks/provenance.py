"""Where a result came from, without torch: the machine (host_info, the load-test client's
own, from octavo.bench.host), the commit, and the JSON file. The scripts that measure no model
(burst_floor.py, cpu_contention.py) import only this, so they start in a fraction of a
second; common.py adds torch's versions for the rest."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from pathlib import Path

from octavo.bench.host import host_info

REPO_ROOT = Path(__file__).resolve().parents[1]


def machine(device: str) -> dict:
    """`host_info()`, and the GPU's name when `device` is CUDA (torch is imported only then,
    so a torch-free script stays so on a CPU)."""
    info = host_info()
    if device.startswith("cuda"):
        import torch

        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def git_commit(root: Path) -> str | None:
    """The short commit of the checkout at `root`, or None outside git."""
    try:
        return subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def product_modified(root: Path) -> bool | None:
    """Whether engine/ or kernels/ of the checkout differ from its HEAD (None outside git): a
    result measured on uncommitted code says so."""
    try:
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "engine", "kernels"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return bool(status.strip())


def header(benchmark: str, machine: dict) -> dict:
    """The first keys of every result: what ran, when, on which `machine`, at which commit
    (and whether engine/ or kernels/ differed from it)."""
    return {
        "benchmark": benchmark,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine,
        "commit": git_commit(REPO_ROOT),
        "product_modified": product_modified(REPO_ROOT),
    }


def write_result(path: Path | None, result: dict) -> None:
    """Writes the result JSON (nothing without a path) and says where."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
