"""Triton kernels (over the paged KV cache, and the fused residual add + LayerNorm), and the
CPU's decode attention in C++ (cpu_ops.py), each with a plain-torch `*_ref` twin."""

from triton.runtime.interpreter import InterpretedFunction

from octavo.kernels.copy_blocks import _copy_blocks_kernel


def interpreter_active() -> bool:
    """True when the kernels were decorated under TRITON_INTERPRET=1 (they run on CPU)."""
    return isinstance(_copy_blocks_kernel, InterpretedFunction)
