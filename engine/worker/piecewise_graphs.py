"""Steps that prefill, replayed piecewise: every layer's work but attention from CUDA graphs.

A decode-only step replays one captured graph (cuda_graphs.py), but a step that also
prefills has a shape no such graph fits: its attention depends on each sequence's query
length. Everything else in a GPT-2 layer works row by row (LayerNorms, the matrix products,
GELU), so for a step of T tokens it is captured once per token bucket, padded to the bucket,
in pieces that attention splits: embeddings + layer 0 up to c_attn; layer i's c_proj to
layer i + 1's c_attn; the last layer's c_proj to ln_f. Between two pieces the host launches
that layer's attention on the real rows, with the step's own metadata, as an eager step
does. A step then costs one graph replay and the attention's launches per layer instead of
every op's launch (vLLM's piecewise CUDA graphs, hand-built: no compiler).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import cast

import torch

from octavo.engine.worker.attention.backend import AttentionMetadata
from octavo.engine.worker.cuda_graphs import batch_size_buckets, capture_graphs
from octavo.engine.worker.models.gpt2 import GPT2Block, GPT2LMHeadModel

# Token buckets: powers of two up to this, then its multiples.
_TOKEN_BUCKET_STEP = 128


def token_buckets(max_num_tokens: int) -> list[int]:
    """1, 2, 4, ... up to 64, then every multiple of 128 below max_num_tokens, then
    max_num_tokens: a step pads its tokens to the smallest bucket holding them."""
    return batch_size_buckets(max_num_tokens, _TOKEN_BUCKET_STEP)


class PiecewiseGraphs:
    """A model's steps of up to max_num_tokens tokens, as pieces per token bucket.

    The pieces read and write static buffers, whose rows past the step's tokens hold
    whatever an earlier step left there (every row is computed on its own, so those rows
    never reach the step's): `input_ids`,
    `positions`; `qkv` [T, qkv_width] (a piece's last c_attn, for the attention after it);
    `attended` [T, C] (that attention's output, for the next piece); `residual` [T, C]
    and `hidden` [T, C] (ln_f's output, the last piece's).

    With `capture` (CUDA), each piece is captured as a graph, all in one memory pool;
    without, the same pieces run op by op, which is how the padding contract is tested on
    a CPU.
    """

    def __init__(
        self, model: GPT2LMHeadModel, kv_cache: torch.Tensor, max_num_tokens: int, capture: bool
    ):
        self.model = model
        self.blocks = cast(list[GPT2Block], list(model.h))
        self.kv_cache = kv_cache
        self.max_num_tokens = max_num_tokens
        self.buckets = token_buckets(max_num_tokens)
        largest = self.buckets[-1]
        config = model.config
        device, dtype = kv_cache.device, kv_cache.dtype
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.qkv = torch.zeros((largest, config.qkv_width), dtype=dtype, device=device)
        self.attended = torch.zeros((largest, config.n_embd), dtype=dtype, device=device)
        self.residual = torch.zeros((largest, config.n_embd), dtype=dtype, device=device)
        self.hidden = torch.zeros((largest, config.n_embd), dtype=dtype, device=device)
        # Per bucket, its pieces in order: each a call of its work, or with `capture` a replay
        # of its graph (`graphs`).
        self.pieces = {size: self._work(size) for size in self.buckets}
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        if capture:
            self._capture()

    def bucket(self, num_tokens: int) -> int:
        """The smallest bucket holding num_tokens rows (num_tokens <= max_num_tokens)."""
        return next(b for b in self.buckets if b >= num_tokens)

    def _work(self, size: int) -> list[Callable[[], None]]:
        """The pieces of bucket `size`, in order: n_layer + 1 of them."""
        model, blocks, rows = self.model, self.blocks, slice(0, size)

        def first() -> None:
            x, residual = model.embed(self.input_ids[rows], self.positions[rows])
            self._keep(rows, *blocks[0].pre_attention(x, residual))

        def between(done: GPT2Block, upcoming: GPT2Block) -> Callable[[], None]:
            def work() -> None:
                x, residual = done.post_attention(self.attended[rows], self.residual[rows])
                self._keep(rows, *upcoming.pre_attention(x, residual))

            return work

        def last() -> None:
            x, residual = blocks[-1].post_attention(self.attended[rows], self.residual[rows])
            self.hidden[rows].copy_(model.final_norm(x, residual))

        return [first, *(between(a, b) for a, b in itertools.pairwise(blocks)), last]

    def _keep(self, rows: slice, qkv: torch.Tensor, residual: torch.Tensor) -> None:
        self.qkv[rows].copy_(qkv)
        self.residual[rows].copy_(residual)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Captures every bucket's pieces (capture_graphs), largest bucket first, all in one
        memory pool."""
        sizes = self.buckets[::-1]
        captured = iter(capture_graphs([work for size in sizes for work in self.pieces[size]]))
        for size in sizes:
            self.graphs[size] = [next(captured)[0] for _ in self.pieces[size]]
            self.pieces[size] = [graph.replay for graph in self.graphs[size]]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The model's hidden states [T, C] for a step of T <= max_num_tokens tokens (the
        model's forward, padded to a bucket). The result is a view of a static buffer,
        valid until the next step."""
        num_tokens = input_ids.shape[0]
        size = self.bucket(num_tokens)
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        pieces = self.pieces[size]
        pieces[0]()
        for layer, block in enumerate(self.blocks):
            attended = block.attn.attend(self.qkv[:num_tokens], self.kv_cache[layer], metadata)
            self.attended[:num_tokens].copy_(attended)
            pieces[layer + 1]()
        return self.hidden[:num_tokens]
