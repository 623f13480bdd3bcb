"""Attention in plain torch over the paged cache: the CPU path (and the kernels' oracle)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata


@dataclass
class PrefillSlice:
    """One sequence with several query tokens: its rows in the batch and what it attends to.

    `key_slots` is None when the sequence has no cached context (its keys are exactly this
    step's keys and a plain causal mask applies); otherwise the cache slots of all its
    seq_len keys and the [q_len, seq_len] mask of which keys each query sees.
    """

    start: int
    end: int
    key_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """Adds gather indices computed once per step: all decodes are one batched SDPA call."""

    store_rows: torch.Tensor | None = None  # rows of k/v to store when some slots are -1
    store_slots: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None  # [num_decodes * max_len] int64
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_len] bool
    decode_max_len: int = 0
    prefills: list[PrefillSlice] | None = None


class TorchAttentionBackend(AttentionBackend):
    """Gathers K/V through the block table and calls scaled_dot_product_attention.

    Decodes are batched: each sequence's keys are gathered into a [num_decodes, max_len] tile
    whose padding points at slot 0 of the null block (kept zero, so masked padding can never
    inject NaN) and is masked out. A prefill without context attends to its own fresh keys;
    one with context (a later chunk, or a recompute) gathers its keys from the cache.
    """

    name = "torch"
    min_block_size = 1

    def prepare(self, metadata: AttentionMetadata) -> TorchAttentionMetadata:
        device = metadata.block_tables.device
        bs = metadata.block_size
        nd = metadata.num_decodes
        fields = {f: getattr(metadata, f) for f in AttentionMetadata.__dataclass_fields__}
        out = TorchAttentionMetadata(**fields, prefills=[])
        out.store_slots = metadata.slot_mapping
        if bool((metadata.slot_mapping < 0).any()):
            out.store_rows = (metadata.slot_mapping >= 0).nonzero().squeeze(1)
            out.store_slots = metadata.slot_mapping[out.store_rows]
        if nd:
            max_len = max(metadata.seq_lens_host[:nd])
            positions = torch.arange(max_len, device=device)
            tables = metadata.block_tables[:nd].long()
            slots = tables[:, positions // bs] * bs + positions % bs  # [nd, max_len]
            valid = positions[None, :] < metadata.seq_lens[:nd, None]
            out.decode_slots = torch.where(valid, slots, 0).reshape(-1)
            out.decode_mask = valid[:, None, None, :]
            out.decode_max_len = max_len
        start = nd
        for i in range(nd, len(metadata.seq_lens_host)):
            q_len, seq_len = metadata.query_lens_host[i], metadata.seq_lens_host[i]
            context = seq_len - q_len
            slots = mask = None
            if context:
                positions = torch.arange(seq_len, device=device)
                table = metadata.block_tables[i].long()
                slots = table[positions // bs] * bs + positions % bs
                query_pos = torch.arange(context, seq_len, device=device)
                mask = positions[None, :] <= query_pos[:, None]
            out.prefills.append(PrefillSlice(start, start + q_len, slots, mask))
            start += q_len
        return out

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
        num_heads, head_dim = q.shape[1], q.shape[2]
        k_flat = kv_cache[0].view(-1, num_heads, head_dim)  # [num_slots, H, D]
        v_flat = kv_cache[1].view(-1, num_heads, head_dim)
        k_new, v_new = k, v
        if metadata.store_rows is not None:
            k_new, v_new = k[metadata.store_rows], v[metadata.store_rows]
        k_flat.index_copy_(0, metadata.store_slots, k_new)
        v_flat.index_copy_(0, metadata.store_slots, v_new)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        nd = metadata.num_decodes
        if nd:
            shape = (nd, metadata.decode_max_len, num_heads, head_dim)
            keys = k_flat.index_select(0, metadata.decode_slots).view(shape).transpose(1, 2)
            values = v_flat.index_select(0, metadata.decode_slots).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), keys, values, attn_mask=metadata.decode_mask, scale=scale
            )  # [nd, H, 1, D]
            out[:nd] = o.squeeze(2)
        for p in metadata.prefills:
            query = q[p.start : p.end].transpose(0, 1)  # [H, q_len, D]
            if p.key_slots is None:
                keys = k[p.start : p.end].transpose(0, 1)
                values = v[p.start : p.end].transpose(0, 1)
                o = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale)
            else:
                keys = k_flat.index_select(0, p.key_slots).transpose(0, 1)  # [H, seq_len, D]
                values = v_flat.index_select(0, p.key_slots).transpose(0, 1)
                o = F.scaled_dot_product_attention(
                    query, keys, values, attn_mask=p.mask, scale=scale
                )
            out[p.start : p.end] = o.transpose(0, 1)
        return out
