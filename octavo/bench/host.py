"""The machine a figure was measured on, without torch: what every result file records
(the load-test client's, and the repository's benchmarks through benchmarks/provenance.py)."""

from __future__ import annotations

import os
import platform
import subprocess


def host_info() -> dict:
    """CPU model (from lscpu), cores, platform and Python."""
    model_name = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                model_name = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.CalledProcessError):
        pass
    return {
        "cpu_model": model_name,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
