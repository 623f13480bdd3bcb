"""Draft tokens from a smaller model with the target's vocabulary (speculative decoding).

The draft model proposes greedily: its k tokens are a function of the sequence so far, so
the target's verification (engine/speculative.py) treats them as a fixed draft and the
output keeps the target's distribution, as with prompt lookup. Its paged K/V cache has the
target's block count and is addressed by the target's block tables (the scheduler allocates
each speculating sequence k lookahead slots past its step, vLLM's num_lookahead_tokens, so
the draft's own proposals have slots too): no allocator of its own. A step computes each
sequence's tokens the draft has not seen (the last one or two after a verification, the
whole prompt for a new sequence), then k - 1 decodes of its own proposals, all sequences in
one forward each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from octavo.engine.worker.attention.backend import AttentionBackend
from octavo.engine.worker.model_runner import allocate_kv_cache
from octavo.engine.worker.models.gpt2 import GPT2LMHeadModel
from octavo.engine.worker.step_inputs import StepInputs, on_device

NULL_BLOCK = 0  # never handed out: padding for block-table rows


@dataclass(frozen=True)
class DraftRequest:
    """A sequence's tokens so far (its last one sampled, not yet in the target's cache), how
    many draft tokens to propose after them, and its block table in the target's cache."""

    seq_id: int
    token_ids: list[int]
    num_tokens: int
    block_ids: list[int]


@dataclass
class _DraftSequence:
    """The draft cache's copy of one sequence: the tokens whose K/V it holds, in order
    (the first `num_confirmed` of them are the sequence's; the rest are the draft's own
    proposals, kept where the target accepted them), and the block table they were
    written through."""

    cached: list[int] = field(default_factory=list)
    num_confirmed: int = 0
    blocks: list[int] = field(default_factory=list)


@dataclass
class _Row:
    """One sequence of a draft forward: the positions it computes, its input tokens."""

    state: _DraftSequence
    input_ids: list[int]
    num_tokens: int  # the draft tokens it proposes (0: a catch-up that proposes nothing)


class DraftModelProposer:
    """Proposes draft tokens with `model` over a cache of `num_blocks` blocks, the target's.

    A draft is as long as the sequence's table has slots for (the lookahead the scheduler
    gave it); a new sequence's prompt is computed at most `max_num_tokens` tokens a step,
    all sequences together (a longer catch-up spans steps, proposing nothing until it is
    done). Sequences longer than the model's positions get no draft. Where a sequence's
    table changed under what the draft wrote (a copy-on-write of a block its samples
    shared), the draft computes again from the first changed block.
    """

    def __init__(
        self,
        model: GPT2LMHeadModel,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        max_num_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.max_positions = model.config.n_positions
        self.device = device
        self.kv_cache = allocate_kv_cache(model.config, num_blocks, block_size, dtype, device)
        self._seqs: dict[int, _DraftSequence] = {}

    @property
    def num_sequences(self) -> int:
        """Sequences whose tokens the draft cache holds."""
        return len(self._seqs)

    def release(self, live_seq_ids: set[int]) -> None:
        """Forgets every sequence not in live_seq_ids (finished, or preempted: its blocks
        went back to the target's free list, and it is computed again when it resumes)."""
        for seq_id in [s for s in self._seqs if s not in live_seq_ids]:
            del self._seqs[seq_id]

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each request's draft: up to `num_tokens` tokens (fewer or none where the cache,
        the catch-up budget or the model's positions fall short)."""
        active = []
        budget = self.max_num_tokens
        for i, request in enumerate(requests):
            row = self._plan(request)
            if row is None:
                continue
            if len(row.input_ids) > budget:  # a catch-up this step cannot finish
                row.input_ids = row.input_ids[:budget]
                row.num_tokens = 0
            budget -= len(row.input_ids)
            if row.input_ids:
                # The first forward caches these inputs, the sequence's own tokens.
                row.state.num_confirmed = len(row.state.cached) + len(row.input_ids)
                active.append((i, row))
        drafts: list[list[int]] = [[] for _ in requests]
        while active:
            next_tokens = self._forward([row for _, row in active])
            still = []
            for (i, row), token in zip(active, next_tokens, strict=True):
                if not row.num_tokens:
                    continue
                drafts[i].append(token)
                if len(drafts[i]) < row.num_tokens:
                    row.input_ids = [token]  # its K/V is computed by the next forward
                    still.append((i, row))
            active = still
        return drafts

    def _plan(self, request: DraftRequest) -> _Row | None:
        """The sequence's rows for its first forward: what the cache lacks of its tokens
        (at least the last); None where it gets no draft."""
        tokens, table = request.token_ids, request.block_ids
        # Its inputs reach position len(tokens) + k - 2: within the model and the table.
        room = min(self.max_positions, len(table) * self.block_size)
        k = min(request.num_tokens, room - len(tokens) + 1)
        if k < 1:
            return None
        state = self._seqs.setdefault(request.seq_id, _DraftSequence())
        # Proposals the target accepted are the sequence's tokens now; the rest are dropped.
        # The last token is always computed again: its logits give the first draft token.
        confirmed = min(state.num_confirmed, len(tokens) - 1)
        limit = min(len(state.cached), len(tokens) - 1)
        while confirmed < limit and state.cached[confirmed] == tokens[confirmed]:
            confirmed += 1
        # Only blocks the table still holds keep what the draft wrote there.
        written = state.blocks
        if table[: len(written)] != written:
            pairs = enumerate(zip(written, table, strict=False))
            same = next((i for i, (a, b) in pairs if a != b), min(len(written), len(table)))
            confirmed = min(confirmed, same * self.block_size)
        del state.cached[confirmed:]
        state.num_confirmed = confirmed
        state.blocks = list(table)
        return _Row(state, tokens[confirmed:], k)

    def _forward(self, rows: list[_Row]) -> list[int]:
        """Runs each row's input tokens after its cached ones (decodes first, as the
        backends expect), stores their K/V, and returns each row's greedy next token."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].input_ids) != 1)
        ordered = [rows[i] for i in order]
        width = max(len(row.state.blocks) for row in ordered)
        table = np.full((len(ordered), width), NULL_BLOCK, dtype=np.int32)
        for r, row in enumerate(ordered):
            table[r, : len(row.state.blocks)] = row.state.blocks
        inputs = StepInputs.build(
            np.concatenate([np.array(row.input_ids, dtype=np.int64) for row in ordered]),
            np.array([len(row.state.cached) for row in ordered], dtype=np.int32),
            np.array([len(row.input_ids) for row in ordered], dtype=np.int32),
            table, np.arange(len(ordered)), self.block_size,
        )  # fmt: skip
        hidden = self.model(
            on_device(inputs.input_ids, self.device),
            on_device(inputs.positions, self.device),
            self.kv_cache,
            self.backend.prepare(inputs.attention_metadata(self.device, self.block_size)),
        )
        last = on_device(inputs.cu_seqlens_q[1:].astype(np.int64) - 1, self.device)
        tokens = self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
        for row in ordered:
            row.state.cached += row.input_ids
        return [tokens[r] for r in np.argsort(order)]  # back in the order of `rows`
