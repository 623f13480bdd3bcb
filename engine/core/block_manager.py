"""KV-cache block bookkeeping: free list, ref counts, block tables, fork and copy-on-write."""

from __future__ import annotations

from octavo.engine.core.sequence import Sequence

NULL_BLOCK = 0  # reserved: padded block-table entries point here, never allocated


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation is attempted without checking `can_append` first."""


class BlockManager:
    """Owns every KV block: which are free, who holds them, and which copies a step must make.

    A sequence's block table lists the physical blocks holding its tokens in order; token `p`
    lives in slot `table[p // block_size] * block_size + p % block_size`. Blocks are ref-counted:
    `fork` makes a child share all of its parent's blocks. Before a sequence writes into a
    block that others still hold (only ever its partially filled last block), `append_slots`
    gives it a private copy and records the `(src, dst)` pair; `take_copies` hands the pairs of
    a step to the model runner, which copies them before storing new K/V.

    It also records, for the model runner's persistent rows, which tables changed (created,
    grown, a copy-on-write swap, a fork) and which were dropped since the last step
    (`take_changes`): a steady decode inside its last block changes nothing.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        # A stack: pop() and append() are O(1); low ids are handed out first.
        self._free_blocks = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self.block_tables: dict[int, list[int]] = {}
        self._copies: list[tuple[int, int]] = []
        self._changed: set[int] = set()
        self._freed: list[int] = []

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, 0.0 when none is."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables[seq.seq_id]

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `append_slots(seq, num_new_tokens)` would take from the free list."""
        table = self.block_tables.get(seq.seq_id, ())
        needed = self.num_blocks_for_tokens(seq.num_computed_tokens + num_new_tokens) - len(table)
        if self._needs_copy_on_write(seq, table):
            needed += 1
        return max(needed, 0)

    def has_slot_in_place(self, seq: Sequence) -> bool:
        """True when the next token of `seq` goes into a block it already holds alone: one
        decode token then needs no allocation, copy or table change (the common step)."""
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            return False
        index = seq.num_computed_tokens // self.block_size
        return index < len(table) and self.ref_counts[table[index]] == 1

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def _needs_copy_on_write(self, seq: Sequence, table) -> bool:
        """True when the next token goes into an existing block that another table holds."""
        position = seq.num_computed_tokens
        if position % self.block_size == 0 or not table:
            return False
        return self.ref_counts[table[position // self.block_size]] > 1

    # -- mutations ---------------------------------------------------------------------------

    def _allocate_block(self) -> int:
        if not self._free_blocks:
            raise NoFreeBlocksError("no free KV-cache block; call can_append first")
        block = self._free_blocks.pop()
        self.ref_counts[block] = 1
        return block

    def _release_block(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free_blocks.append(block)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Makes room for the tokens [num_computed, num_computed + num_new_tokens) of `seq`.

        Copy-on-write happens here: a shared partial last block is replaced in this table by a
        fresh block, the pair is recorded for copying, and the old block loses one reference.
        """
        if self.num_new_blocks_needed(seq, num_new_tokens) > self.num_free_blocks:
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs more blocks than are free")
        table = self.block_tables.setdefault(seq.seq_id, [])
        target = self.num_blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        if len(table) < target:
            self._changed.add(seq.seq_id)
        if self._needs_copy_on_write(seq, table):
            self._changed.add(seq.seq_id)
            index = seq.num_computed_tokens // self.block_size
            src = table[index]
            dst = self._allocate_block()
            table[index] = dst
            self._release_block(src)
            self._copies.append((src, dst))
        while len(table) < target:
            table.append(self._allocate_block())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Gives `child` its parent's table; every shared block gains one reference."""
        table = self.block_tables[parent.seq_id]
        for block in table:
            self.ref_counts[block] += 1
        self.block_tables[child.seq_id] = list(table)
        self._changed.add(child.seq_id)

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s table; blocks nobody else holds go back to the free list."""
        table = self.block_tables.pop(seq.seq_id, None)
        if table is None:
            return
        self._changed.discard(seq.seq_id)
        self._freed.append(seq.seq_id)
        for block in reversed(table):
            self._release_block(block)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies recorded since the last call, in recording order."""
        copies, self._copies = self._copies, []
        return copies

    def take_changes(self) -> tuple[set[int], list[int]]:
        """(ids of sequences whose tables changed, ids of sequences whose tables were
        dropped) since the last call."""
        changed, freed = self._changed, self._freed
        self._changed, self._freed = set(), []
        return changed, freed

    # -- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent."""
        holders = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block in table:
                holders[block] += 1
        free = set(self._free_blocks)
        assert len(free) == len(self._free_blocks), "a block is on the free list twice"
        assert NULL_BLOCK not in free and holders[NULL_BLOCK] == 0, "the null block is in use"
        used = sum(1 for b in range(1, self.num_blocks) if holders[b] > 0)
        assert len(free) + used == self.num_usable_blocks, "free + used != total"
        for block in range(1, self.num_blocks):
            assert self.ref_counts[block] == holders[block], (
                f"block {block}: ref count {self.ref_counts[block]} != {holders[block]} holders"
            )
            assert not (block in free and holders[block]), f"free block {block} is referenced"
