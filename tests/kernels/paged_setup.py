"""Random paged batches for kernel tests: shuffled block tables, NaN in every unused slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.cu_seqlens_q,
            self.max_seqlen_q,
            self.max_seqlen_k,
        )

    def permuted(self, seed: int) -> PagedBatch:
        """The same logical batch with its physical blocks moved to other ids."""
        num_blocks = self.k_cache.shape[0]
        perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
        new_id = torch.cat([torch.zeros(1, dtype=torch.long), perm])  # block 0 stays null
        k, v = torch.empty_like(self.k_cache), torch.empty_like(self.v_cache)
        k[new_id], v[new_id] = self.k_cache, self.v_cache
        tables = new_id[self.block_tables.long()].to(torch.int32)
        return PagedBatch(
            self.q,
            k,
            v,
            tables,
            self.seq_lens,
            self.cu_seqlens_q,
            self.max_seqlen_q,
            self.max_seqlen_k,
            self.scale,
        )


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cpu",
    extra_blocks: int = 3,
    num_kv_heads: int | None = None,
) -> PagedBatch:
    """q has num_heads query heads; the cache num_kv_heads K/V heads (default: as many)."""
    generator = torch.Generator().manual_seed(seed)
    kv_heads = num_kv_heads or num_heads
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks + 1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_cache[0] = v_cache[0] = 0  # the null block
    physical = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = []
    for seq_len, count in zip(seq_lens, blocks_per_seq, strict=True):
        table, physical = physical[:count], physical[count:]
        tables.append(table)
        for pos in range(seq_len):  # only real positions get values; the rest stay NaN
            block, offset = table[pos // block_size], pos % block_size
            k_cache[block, offset] = torch.randn(kv_heads, head_dim, generator=generator)
            v_cache[block, offset] = torch.randn(kv_heads, head_dim, generator=generator)
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], num_heads, head_dim, generator=generator).to(dtype)
    return PagedBatch(
        q.to(device), k_cache.to(device), v_cache.to(device), block_tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.tensor(cu, dtype=torch.int32, device=device),
        max(query_lens), max(seq_lens), head_dim**-0.5,
    )  # fmt: skip
