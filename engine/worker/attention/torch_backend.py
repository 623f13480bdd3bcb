"""Attention over the paged cache on a CPU: decodes through the in-place decode kernel
(kernels/cpu_ops.py), everything else in plain torch (gathered keys, SDPA)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from octavo.engine.worker.attention.backend import AttentionBackend, AttentionMetadata
from octavo.kernels import cpu_ops


@dataclass
class SequenceSlice:
    """One sequence of the batch: its query rows and the keys it attends to.

    `key_slots` is None when the sequence has no cached context (its keys are exactly this
    step's keys and a plain causal mask applies); otherwise the cache slots of all its
    seq_len keys, with `mask` [q_len, seq_len] saying which keys each query sees (None for a
    single query, which sees them all).
    """

    start: int
    end: int
    key_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """Adds the plan, computed once per step for all layers: `key_slots` [S, max_seqlen_k],
    every key position's cache slot (the decode kernel reads the leading `kernel_decodes`
    rows: the step's decodes where the kernel is built, else none); one slice per other
    sequence (`sequences`)."""

    store_rows: torch.Tensor | None = None  # rows of k/v to store when some slots are -1
    store_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    key_slots: torch.Tensor | None = None
    kernel_decodes: int = 0
    sequences: list[SequenceSlice] = field(default_factory=list)


class TorchAttentionBackend(AttentionBackend):
    """Decodes (one query token each) go to the decode kernel, which reads their keys in the
    cache, all decodes of a layer in one call. Other sequences gather K/V through the block
    tables and call SDPA, one call each (as decodes do where the kernel cannot be built, or
    off the CPU).

    Grouped queries (fewer K/V heads than query heads, multi-query attention) never copy K/V
    per query head: the G query heads that share a K/V head become G query rows of that head
    (a decode's [H, D] query is a [H_kv, G, D] batch of G rows; a prefill's rows are
    (position, group) pairs, each position's mask row repeated G times).

    A prefill without context attends to its own fresh keys with a causal mask; one with
    context (a later chunk, a recompute) gathers its keys from the cache and masks in
    absolute positions.
    """

    name = "torch"

    def prepare(self, metadata: AttentionMetadata) -> TorchAttentionMetadata:
        """The plan of `TorchAttentionMetadata` for this step (the first CPU step builds or
        loads the decode kernel)."""
        fields = {f: getattr(metadata, f) for f in AttentionMetadata.__dataclass_fields__}
        out = TorchAttentionMetadata(**fields, store_slots=metadata.slot_mapping, sequences=[])
        if len(metadata.slot_mapping) and metadata.slot_mapping.min().item() < 0:
            out.store_rows = (metadata.slot_mapping >= 0).nonzero().squeeze(1)
            out.store_slots = metadata.slot_mapping[out.store_rows]
        out.key_slots = key_slots = self._key_slots(metadata)
        device = metadata.slot_mapping.device
        # Decodes go to the decode kernel on a CPU where it is built; otherwise to SDPA, as
        # sequences of one query (their tokens' indices are theirs).
        if metadata.num_decodes and device.type == "cpu" and cpu_ops.load():
            out.kernel_decodes = metadata.num_decodes
        start = out.kernel_decodes
        for i in range(out.kernel_decodes, len(metadata.seq_lens_host)):
            q_len, seq_len = metadata.query_lens_host[i], metadata.seq_lens_host[i]
            context = seq_len - q_len
            slots = mask = None
            if context:
                slots = key_slots[i][:seq_len]
                if q_len > 1:
                    keys = torch.arange(seq_len, device=device)
                    queries = torch.arange(context, seq_len, device=device)
                    mask = keys[None, :] <= queries[:, None]
            out.sequences.append(SequenceSlice(start, start + q_len, slots, mask))
            start += q_len
        return out

    @staticmethod
    def _key_slots(metadata: AttentionMetadata) -> torch.Tensor:
        """[S, max_seqlen_k] cache slot of every key position of every sequence."""
        bs = metadata.block_size
        shift = bs.bit_length() - 1  # a power of two: shifts and ors, not int64 arithmetic
        tables = metadata.block_tables
        offsets = torch.arange(bs, device=tables.device)
        # Every block's slots side by side: a broadcast, cheaper on CPU than indexing by
        # position (a gather of S x max_seqlen_k table entries).
        slots = ((tables.long() << shift).unsqueeze(-1) | offsets).view(tables.shape[0], -1)
        return slots[:, : metadata.max_seqlen_k]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchAttentionMetadata), "call prepare() first"
        head_dim, num_kv_heads = q.shape[2], kv_cache.shape[-2]
        k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_slots, H_kv, D]
        v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
        k_new, v_new = k, v
        if metadata.store_rows is not None:
            k_new, v_new = k[metadata.store_rows], v[metadata.store_rows]
        k_flat.index_copy_(0, metadata.store_slots, k_new)
        v_flat.index_copy_(0, metadata.store_slots, v_new)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        num = metadata.kernel_decodes
        if num:
            assert metadata.key_slots is not None
            cpu_ops.decode_attention(
                q[:num], k_flat, v_flat, metadata.key_slots[:num], metadata.seq_lens[:num],
                scale, out[:num],
            )  # fmt: skip
        # One SDPA call per other sequence, each writing its rows of `out`. With G query
        # heads per K/V head, a sequence's q_len x G queries of one K/V head are one
        # [q_len * G, D] block (row = position * G + member) and each position's mask row is
        # repeated G times: K/V are read once per K/V head. G = 1 (GPT-2) takes none of
        # those steps.
        group = q.shape[1] // num_kv_heads
        for s in metadata.sequences:
            q_len = s.end - s.start
            query = q[s.start : s.end].transpose(0, 1)  # [H, q_len, D]
            if group > 1:  # -> [H_kv, q_len * G, D] (a copy of the queries only)
                query = query.view(num_kv_heads, group, q_len, head_dim).transpose(1, 2)
                query = query.reshape(num_kv_heads, q_len * group, head_dim)
            if s.key_slots is None:
                keys = k[s.start : s.end].transpose(0, 1)  # [H_kv, q_len, D]
                values = v[s.start : s.end].transpose(0, 1)
                mask, causal = None, True
            else:
                keys = k_flat.index_select(0, s.key_slots).transpose(0, 1)  # [H_kv, seq_len, D]
                values = v_flat.index_select(0, s.key_slots).transpose(0, 1)
                mask, causal = s.mask, False
            if group > 1:
                if causal:  # SDPA's is_causal would align rows, not positions, with keys
                    positions = torch.arange(q_len, device=q.device)
                    mask, causal = positions[None, :] <= positions[:, None], False
                if mask is not None:
                    mask = mask.repeat_interleave(group, dim=0)  # [q_len * G, keys]
            # A leading batch of one: SDPA takes its fused CPU kernel (flash attention) for
            # 4-D inputs only; 3-D ones fall back to the unfused math path, several times
            # slower (and slower still in bfloat16).
            o = F.scaled_dot_product_attention(
                query[None], keys[None], values[None], attn_mask=mask, is_causal=causal,
                scale=scale,
            )[0]  # fmt: skip
            if group == 1:
                out[s.start : s.end] = o.transpose(0, 1)
            else:  # [H_kv, q_len * G, D] -> this sequence's rows of out, [q_len, H, D]
                rows = out[s.start : s.end].view(q_len, num_kv_heads, group, head_dim)
                rows.copy_(o.view(num_kv_heads, q_len, group, head_dim).transpose(0, 1))
        return out
