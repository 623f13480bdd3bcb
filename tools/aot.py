"""Ahead-of-time compilation of the kernels for an NVIDIA GPU, on a machine that has none.

The Triton interpreter that runs the kernels in CPU tests accepts code the GPU compiler
rejects (tl.dot tiles under 16, mixed-width operands), and it cannot tell whether a kernel
spills registers or needs more shared memory than a block may have. This module records
the launches the real launchers make for GPT-2 and GPTBigCode shapes (each kernel is swapped for a
recorder, so nothing runs), specializes every launch exactly as Triton's JIT would at that
call, compiles it through Triton's NVIDIA pipeline down to a cubin with the ptxas shipped in
the triton wheel, and reads the cubin's resource usage with cuobjdump. No driver is needed.

    python -m tools.aot --arch 90 --arch 80 [--json PATH]

Import it without TRITON_INTERPRET=1: the interpreter replaces the JIT functions. It uses
two helpers of Triton's JIT (the binder and _pack_args) and so follows the pinned Triton
(constraints.txt); a GPU machine with another Triton compiles with its own version.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from octavo.engine.worker.models.configs import GPT2Config
from octavo.kernels import copy_blocks as copy_blocks_module
from octavo.kernels import layer_norm as layer_norm_module
from octavo.kernels import paged_attention as paged_attention_module

KERNEL_MODULES: tuple[ModuleType, ...] = (
    paged_attention_module,
    copy_blocks_module,
    layer_norm_module,
)

# Shared memory one block may use (opt-in maximum), bytes, per compute capability.
SHARED_MEMORY_PER_BLOCK = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
THREADS_PER_WARP = 32
# 16-byte loads from global memory: into registers, or into shared memory by cp.async.cg
# (which only moves 16 bytes); the pipelined tl.dot loop loads through the latter.
VECTOR_LOAD_PTX = r"\bld\.global(?:\.\w+)*\.v4\.b32|\bcp\.async\.cg\.shared\.global\b"

# GPT-2 small, medium, large and xl: head_dim is 64 in all four.
GPT2_HEAD_COUNTS = (12, 16, 20, 25)
GPT2_HEAD_DIM = 64
# Rows in the recorded add_layer_norm launches (a decode batch; the row count is not
# specialized on).
WORKLOAD_ROWS = 8
# GPTBigCode with multi-query attention at GPT-2 small's size: one K/V head for 12 query
# heads (the grouped kernels' GROUP_SIZE 12).
MULTI_QUERY_HEADS = 12
# A head narrower than tl.dot's least inner dimension (16), as small configurations have
# (the suite's GPTBigCode: 4 heads of 8, one K/V head), in the suite's float32.
NARROW_HEADS, NARROW_HEAD_DIM = 4, 8
# The engine's default block size, and a context that spans several blocks and decode splits.
WORKLOAD_BLOCK_SIZE = 16
WORKLOAD_CONTEXT = 1024
# Decode split factors to cover: one per reduce-kernel width (SPLITS = next power of two).
WORKLOAD_SPLITS = (1, 2, 4, 8, paged_attention_module.MAX_SPLITS)
WORKLOAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A cache whose per-layer plane passes 2**31 elements: Triton then passes the plane stride
# as i64, a variant of its own.
LARGE_CACHE_BLOCKS = 2**31 // (WORKLOAD_BLOCK_SIZE * GPT2_HEAD_COUNTS[0] * GPT2_HEAD_DIM) + 1


@dataclass(frozen=True)
class KernelLaunch:
    """One `kernel[grid](*args, **kwargs)` call a launcher made."""

    kernel: JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class ResourceUsage:
    """Per-thread registers, spilled (local) bytes and stack, per-block shared memory."""

    registers: int
    spill_bytes: int
    stack_bytes: int
    shared_bytes: int


@dataclass(frozen=True)
class CompiledVariant:
    """One specialization of one kernel, compiled for one architecture."""

    kernel: str
    arch: int
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    usage: ResourceUsage
    # Read off the PTX: matrix instructions (mma / wgmma), and 16-byte global loads.
    tensor_core_ops: int
    vector_loads: int
    problems: list[str] = field(default_factory=list)


class _Recorder:
    """Stands in for a JIT kernel: `recorder[grid](...)` records the call instead of running."""

    def __init__(self, kernel: JITFunction, launches: list[KernelLaunch]):
        self.kernel = kernel
        self.launches = launches

    def __getitem__(self, grid):
        def record(*args, **kwargs) -> None:
            self.launches.append(KernelLaunch(self.kernel, args, kwargs))

        return record


@contextmanager
def recorded_launches() -> Iterator[list[KernelLaunch]]:
    """Within the block, kernel launches in KERNEL_MODULES are recorded, not run."""
    launches: list[KernelLaunch] = []
    swapped = [
        (module, name, obj)
        for module in KERNEL_MODULES
        for name, obj in vars(module).items()
        if isinstance(obj, JITFunction)
    ]
    if not swapped:
        raise RuntimeError("no JIT kernels found: is TRITON_INTERPRET set?")
    for module, name, obj in swapped:
        setattr(module, name, _Recorder(obj, launches))
    try:
        yield launches
    finally:
        for module, name, obj in swapped:
            setattr(module, name, obj)


def gpt2_workload() -> list[KernelLaunch]:
    """The launches the triton attention backend makes for GPT-2 small to xl and a
    multi-query GPTBigCode, in every dtype: the step's keys and values as strided views of
    the fused qkv projection (stored by the attention kernels themselves), a mixed prefill +
    decode batch, decode batches at every split factor,
    copy-on-write copies over a small two-layer cache and over one whose per-layer plane
    passes 2**31 elements, and the residual add + LayerNorm at each model's width."""
    with recorded_launches() as launches:
        for dtype in WORKLOAD_DTYPES:
            for num_heads in GPT2_HEAD_COUNTS:
                _attention_launches(num_heads, num_heads, dtype)
                _layer_norm_launch(num_heads * GPT2_HEAD_DIM, dtype)
            _attention_launches(MULTI_QUERY_HEADS, 1, dtype)
            _copy_launch(GPT2_HEAD_COUNTS[0], dtype, num_blocks=8)
            _copy_launch(GPT2_HEAD_COUNTS[0], dtype, num_blocks=LARGE_CACHE_BLOCKS)
        _attention_launches(NARROW_HEADS, 1, torch.float32, NARROW_HEAD_DIM, splits=(1,))
    return launches


def _attention_launches(
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    head_dim: int = GPT2_HEAD_DIM,
    splits: tuple[int, ...] = WORKLOAD_SPLITS,
) -> None:
    block_size = WORKLOAD_BLOCK_SIZE
    blocks_per_seq = WORKLOAD_CONTEXT // block_size
    num_seqs = 4
    k_cache, v_cache = torch.zeros(
        (2, num_seqs * blocks_per_seq + 1, block_size, num_kv_heads, head_dim), dtype=dtype
    )
    block_tables = torch.arange(1, num_seqs * blocks_per_seq + 1, dtype=torch.int32).view(
        num_seqs, blocks_per_seq
    )
    scale = head_dim**-0.5
    # Mixed batch: one decode, then a 100-token chunk after 200 tokens of context; the
    # decode on the tl.dot path, then on the decode path (the chunk's launch then reads
    # seq_lens and cu_seqlens_q from one element in, which must compile to the variant the
    # aligned launch compiles).
    query_lens, seq_lens = [1, 100], [WORKLOAD_CONTEXT, 300]
    for num_decodes in (0, 1):
        _store_and_attend(
            k_cache, v_cache, num_heads, block_tables[:2], query_lens, seq_lens, scale, None,
            num_decodes,
        )  # fmt: skip
    # Block tables one and 16 blocks wide (a step's longest sequence sets the width): Triton
    # would specialize the row stride on 1 and on multiples of 16 if it were let.
    for width in (1, 16):
        _store_and_attend(
            k_cache, v_cache, num_heads, block_tables[:2, :width].contiguous(), [1, 8],
            [width * block_size, 8], scale, None, 1,
        )  # fmt: skip
    for num_splits in splits:
        decode_lens = [WORKLOAD_CONTEXT] * num_seqs
        _store_and_attend(
            k_cache, v_cache, num_heads, block_tables, [1] * num_seqs, decode_lens, scale,
            num_splits,
        )  # fmt: skip


def _store_and_attend(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    num_splits: int | None,
    num_decodes: int = 0,
) -> None:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = sum(query_lens)
    # q, k, v as the models make them: strided views of one [T, (H + 2 KV) * D] projection.
    qkv = torch.zeros((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype=k_cache.dtype)
    widths = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
    q_part, k_part, v_part = qkv.split(widths, dim=-1)
    q = q_part.view(num_tokens, num_heads, head_dim)
    k = k_part.view(num_tokens, num_kv_heads, head_dim)
    v = v_part.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.arange(num_tokens, dtype=torch.int64) + block_size
    cu_seqlens_q = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
    )
    paged_attention_module.paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q,
        max(query_lens),
        max(seq_lens),
        torch.empty_like(q),
        scale,
        num_splits=num_splits,
        num_decodes=num_decodes,
        key=k,
        value=v,
        slot_mapping=slots,
    )


def _layer_norm_launch(width: int, dtype: torch.dtype) -> None:
    hidden = torch.zeros((WORKLOAD_ROWS, width), dtype=dtype)
    weight = torch.ones(width, dtype=dtype)
    layer_norm_module.add_layer_norm(hidden, hidden, weight, weight, GPT2Config.layer_norm_epsilon)


def _copy_launch(num_heads: int, dtype: torch.dtype, num_blocks: int) -> None:
    # A meta tensor: shapes and strides without memory, so a cache of any size can be recorded.
    kv_cache = torch.empty(
        (2, 2, num_blocks, WORKLOAD_BLOCK_SIZE, num_heads, GPT2_HEAD_DIM),
        dtype=dtype,
        device="meta",
    )
    copy_blocks_module.copy_blocks(kv_cache, torch.tensor([[1, 2], [3, 4]], dtype=torch.int64))


def compile_launch(launch: KernelLaunch, target: GPUTarget) -> triton.compiler.CompiledKernel:
    """Compiles the variant that `launch` would compile on `target`.

    Uses Triton's own launch-time binder (as JITFunction.run does), so the signature, the
    integer and alignment specializations (i32 or i64, tt.divisibility 16, ints equal to 1)
    and the options are those of a real launch with the same arguments.
    """
    kernel = launch.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**launch.kwargs, "debug": False}
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def resource_usage(cubin: bytes) -> ResourceUsage:
    """Reads REG, LOCAL, STACK and SHARED of the cubin's one function with cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "-res-usage", file.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", report))
    return ResourceUsage(
        registers=int(fields["REG"]),
        spill_bytes=int(fields["LOCAL"]),
        stack_bytes=int(fields["STACK"]),
        shared_bytes=int(fields["SHARED"]),
    )


def compile_variants(launches: list[KernelLaunch], arch: int) -> list[CompiledVariant]:
    """Compiles each distinct specialization among `launches` once, for sm_<arch>."""
    target = GPUTarget("cuda", arch, THREADS_PER_WARP)
    variants: dict[str, CompiledVariant] = {}
    for launch in launches:
        compiled = compile_launch(launch, target)
        if compiled.hash in variants:
            continue
        metadata = compiled.metadata
        usage = resource_usage(compiled.asm["cubin"])
        # Triton's shared-memory figure is dynamic shared memory, on top of the static.
        shared = usage.shared_bytes + metadata.shared
        problems = []
        if usage.spill_bytes:
            problems.append(f"spills {usage.spill_bytes} bytes to local memory")
        if shared > SHARED_MEMORY_PER_BLOCK[arch]:
            problems.append(f"needs {shared} bytes of shared memory")
        ptx = compiled.asm["ptx"]
        arg_names = launch.kernel.arg_names
        variants[compiled.hash] = CompiledVariant(
            kernel=metadata.name,
            arch=arch,
            signature={k: v for k, v in compiled.src.signature.items() if v != "constexpr"},
            constexprs={arg_names[path[0]]: v for path, v in compiled.src.constants.items()},
            num_warps=metadata.num_warps,
            num_stages=metadata.num_stages,
            usage=ResourceUsage(usage.registers, usage.spill_bytes, usage.stack_bytes, shared),
            tensor_core_ops=len(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\b", ptx)),
            vector_loads=len(re.findall(VECTOR_LOAD_PTX, ptx)),
            problems=problems,
        )
    return list(variants.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch", type=int, action="append", choices=sorted(SHARED_MEMORY_PER_BLOCK)
    )
    parser.add_argument("--json", type=Path, help="write every variant as JSON here")
    args = parser.parse_args(argv)
    launches = gpt2_workload()
    variants = [v for arch in args.arch or [90] for v in compile_variants(launches, arch)]
    for v in variants:
        dtype = next(t for n, t in v.signature.items() if t.startswith("*"))
        flags = " ".join(f"{k}={val}" for k, val in v.constexprs.items())
        print(
            f"sm_{v.arch} {v.kernel:24} {dtype:6} warps={v.num_warps} stages={v.num_stages} "
            f"regs={v.usage.registers:3} spill={v.usage.spill_bytes} "
            f"shared={v.usage.shared_bytes:6} mma={v.tensor_core_ops:2} ldg128={v.vector_loads:2}  "
            f"{flags}  {'; '.join(v.problems)}"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(v) for v in variants], indent=1))
    failed = [v for v in variants if v.problems]
    print(f"{len(variants)} variants from {len(launches)} launches, {len(failed)} with problems")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
