"""Which way a step's forward runs: a full decode graph (or the CPU's fused decode step),
piecewise graphs, or eagerly."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from octavo.engine.worker.cuda_graphs import DecodeGraphs
from octavo.engine.worker.fused_decode import FusedDecode
from octavo.engine.worker.piecewise_graphs import PiecewiseGraphs


class CUDAGraphMode(enum.Enum):
    """How one step's model forward runs; every mode yields the step's hidden states."""

    NONE = "none"  # eagerly, op by op
    PIECEWISE = "piecewise"  # captured pieces around eager attention
    FULL = "full"  # the whole decode step at once: a captured graph, or one fused CPU call


@dataclass
class CudagraphDispatcher:
    """The graphs an engine captured (or its fused CPU decode step), and the rule choosing
    among them per step.

    FULL takes a uniform decode (every sequence decodes one token and samples it, in
    order) of at most `full.max_batch_size` sequences, rows of one sequence only where the
    full step stores every key before it reads (`full.stores_first`); PIECEWISE any other
    step of at most `piecewise.max_num_tokens` tokens; NONE the rest. Without either (enforce_eager,
    or a model the fused step cannot run), every step is NONE.
    """

    full: DecodeGraphs | FusedDecode | None = None
    piecewise: PiecewiseGraphs | None = None

    def dispatch(
        self, num_tokens: int, uniform_decode: bool, decodes_share_sequences: bool
    ) -> CUDAGraphMode:
        """The mode of a step of `num_tokens` tokens (one per sequence if uniform_decode;
        `decodes_share_sequences`: several of them positions of one sequence, which only a
        full step that stores every key before it reads may take)."""
        full = self.full
        if (
            full is not None
            and uniform_decode
            and num_tokens <= full.max_batch_size
            and (full.stores_first or not decodes_share_sequences)
        ):
            return CUDAGraphMode.FULL
        if self.piecewise is not None and num_tokens <= self.piecewise.max_num_tokens:
            return CUDAGraphMode.PIECEWISE
        return CUDAGraphMode.NONE
