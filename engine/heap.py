"""Keeping the garbage collector off the startup heap of a long-running process."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Moves every object alive now (modules, the model, the app) out of the collector's
    reach, after one full collection so that no garbage is frozen with them.

    A server process starts with a few hundred thousand tracked objects (torch alone brings
    most of them) that live as long as it does; each full collection would walk all of them,
    and the per-step allocations of streaming (outputs, events) trigger one every few
    steps. Decoding one step's outputs for 256 requests takes ~2 ms with the heap tracked and
    ~0.3 ms with it frozen on this CPU. vLLM freezes its server and core processes the same
    way. Only for processes we own: `LLM` in a user's process leaves their heap alone.
    """
    gc.collect()
    gc.freeze()
