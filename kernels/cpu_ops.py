"""The CPU's C++ operators (cpu/*.cpp), compiled for this machine on first use, each with a
plain-torch twin:

- `decode_attention`: paged decode attention reading each sequence's keys where they lie
  (plain torch must first gather them out of their blocks, a copy as large as the keys, every
  layer, every step); twin paged_attention.py's paged_attention_ref (docs/benchmarks/history.md,
  "Decode attention in place");
- `add_lora_`: the LoRA adapters' share of a product for rows of several adapters, one op
  where torch takes a gather, two batched products and a scatter; twin
  engine/worker/lora.py's add_lora_ref;
- `quantize_rows`, `rescale_rows_`: an int8 layer's per-token activation scaling, one op each
  where torch takes several small ones; twins in engine/worker/models/quantization.py.

They are built with torch's C++ extension loader (g++ and ninja; from 10 s to minutes once,
then cached under torch's extensions folder), for the CPU they run on (-march=native). The
build's name carries this CPU's feature flags, torch's version and where the sources lie, so a
home folder shared by other CPUs, venvs or installs gets a build each: ninja rebuilds a build
whose sources' paths change, and two installs taking turns on one folder would each rebuild it
on every first load. `load()` returns False, with the reason logged once,
where they cannot be built; callers then take their twins' torch path.

Every load, built or not, runs under torch's lock file in the build folder, which a process
killed while holding it leaves behind, and every later load then waits on it forever. So loads
take a lock of their own first, an flock the kernel drops with its holder: whoever holds it is
the only loader alive, and any torch lock file it finds is a dead one's, removed.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).resolve().parent / "cpu").glob("*.cpp"))
HEADERS = sorted((Path(__file__).resolve().parent / "cpu").glob("*.h"))
# -ffast-math lets the compiler vectorize the softmax's exp (glibc's vector exp) and the dot
# products' sums; compile flags only, so the process's floating-point mode is left alone.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def _cpu_flags() -> str:
    """This CPU's feature flags, from /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def build_folder() -> Path:
    """Where this CPU's build of the operators lies: under TORCH_EXTENSIONS_DIR where it is
    set, else torch's extensions folder, named for this CPU, torch's version, the sources and
    their folder."""
    from torch.utils import cpp_extension

    text = _cpu_flags() + torch.__version__ + str(SOURCES[0].parent)
    text += "".join(source.read_text() for source in SOURCES + HEADERS)
    name = f"octavo_cpu_ops_{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / name


@functools.cache
def load() -> bool:
    """Builds (or finds built) and loads the operators into torch.ops.octavo_cpu; False, with
    a warning naming why, where they cannot be (no compiler, no ninja, a failed build)."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        try:  # the `ninja` package's binary, in a venv that is not activated
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    build_directory = build_folder()
    name = build_directory.name
    try:
        build_directory.mkdir(parents=True, exist_ok=True)
        with open(build_directory.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            # The only loader alive holds the flock: torch's lock file here is a dead one's.
            (build_directory / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name=name,
                sources=[str(source) for source in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_directory),
                is_python_module=False,
            )
    except Exception as exc:  # noqa: BLE001 - any build failure: the twins run, said once
        last_line = (str(exc).strip().splitlines() or [""])[-1]
        logger.warning(
            "the CPU's C++ operators could not be built (%s: %s); decodes gather their keys "
            "and int8 layers scale in torch instead, slower (they need g++ and ninja)",
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


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantization.quantize_activations(x) in one op: (q uint8 [R, C], the codes offset by
    128; scale float32 [R, 1])."""
    q, scale = torch.ops.octavo_cpu.quantize_rows(x)
    return q, scale


def rescale_rows_(out: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out[r] = out[r] * scale[r] + bias in place (float32 arithmetic), for out [R, N] with
    contiguous rows, scale float32 with at least R rows, bias [N] in out's dtype or None."""
    torch.ops.octavo_cpu.rescale_rows_(out, scale, bias)


def add_lora_(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """out[t] += (x[t] @ lora_a[s]) @ lora_b[s] in place for s = token_slots[t] (a row of -1
    is left), in float32 arithmetic: out [T, N] and x [T, K] with contiguous rows, lora_a
    [S, K, R] and lora_b [S, R, N] contiguous with R a multiple of 16, token_slots int64 [T];
    all of one dtype (float32, bfloat16 or float16). Needs load() to have returned True."""
    torch.ops.octavo_cpu.add_lora_(out, x, lora_a, lora_b, token_slots)
