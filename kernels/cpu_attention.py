"""Paged decode attention on a CPU (cpu/decode_attention.cpp), compiled for this machine on
first use; its twin is paged_attention.py's paged_attention_ref.

Plain torch can only attend over a sequence's keys after gathering them out of their blocks
(a copy as large as the keys, every layer, every step); this kernel reads them where they
lie. It is built with torch's C++ extension loader (g++ and ninja; about 10 s once, then
cached under torch's extensions folder), for the CPU it runs on (-march=native: the folder's
name carries this CPU's feature flags, so a home folder shared by other CPUs gets a build
each). `load()` returns None, with the reason logged once, where it cannot be built; the
attention backend then gathers (benchmarks/README, "Decode attention in place").
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "cpu" / "decode_attention.cpp"
# -ffast-math lets the compiler vectorize the softmax's exp (glibc's vector exp) and the dot
# products' sums; compile flags only, so the process's floating-point mode is left alone.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"]


def _cpu_flags() -> str:
    """This CPU's feature flags, from /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


@functools.cache
def load() -> bool:
    """Builds (or finds built) and loads the kernel into torch.ops.octavo_cpu; False, with a
    warning naming why, where it cannot be (no compiler, no ninja, a failed build)."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        try:  # the `ninja` package's binary, in a venv that is not activated
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    digest = hashlib.sha256((_cpu_flags() + SOURCE.read_text()).encode()).hexdigest()[:12]
    try:
        cpp_extension.load(
            name=f"octavo_cpu_attention_{digest}",
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            is_python_module=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure: gather instead, said once
        last_line = (str(exc).strip().splitlines() or [""])[-1]
        logger.warning(
            "the CPU decode attention kernel could not be built (%s: %s); decodes gather "
            "their keys instead, slower (it needs g++ and ninja)",
            type(exc).__name__,
            last_line,
        )
        return False
    return True


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """out[n, h] = softmax(q[n, h] K_n^T * scale) V_n for one query token per sequence, K_n
    and V_n being sequence n's first seq_lens[n] keys and values of its K/V head, read at
    their cache slots key_slots[n, :seq_lens[n]]. q, out [N, H, D] (head_dim contiguous);
    caches [num_slots, H_kv, D] contiguous; key_slots int64 [N, >= max seq_len]; seq_lens
    int32 [N]. Needs load() to have returned True."""
    torch.ops.octavo_cpu.decode_attention(q, k_cache, v_cache, key_slots, seq_lens, scale, out)
    return out
