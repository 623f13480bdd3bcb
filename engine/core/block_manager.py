"""KV-cache block bookkeeping: free list, ref counts, block tables, fork and copy-on-write,
and the prefix cache (full blocks found again by the hash of their tokens and prefix)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from octavo.engine.core.sequence import Sequence

NULL_BLOCK = 0  # reserved: padded block-table entries point here, never allocated
# The parent hash of a sequence's first block.
ROOT_HASH = b""
# Token ids as hashed: 32-bit, enough for any GPT-2 vocabulary.
TOKEN_TYPECODE = "i"


@dataclass(slots=True)
class _BlockNames:
    """A sequence's full-block names, in order, and how many of its blocks `_register` has
    seen (so each block is looked at once, not at every allocation)."""

    names: list[bytes] = field(default_factory=list)
    num_registered: int = 0


def root_hash(lora_int_id: int) -> bytes:
    """The parent hash of a sequence's first block: the same prompt under two LoRA adapters
    (or an adapter and the base) has other K/V, so other names."""
    return ROOT_HASH if not lora_int_id else b"lora:%d" % lora_int_id


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation is attempted without checking `num_new_blocks_needed`
    against `num_free_blocks` first."""


class BlockManager:
    """Owns every KV block: which are free, who holds them, and which copies a step must make.

    A sequence's block table lists the physical blocks holding its tokens in order; token `p`
    lives in slot `table[p // block_size] * block_size + p % block_size`. Blocks are ref-counted:
    `fork` makes a child share all of its parent's blocks. Before a sequence writes into a
    block that others still hold (only ever its partially filled last block), `allocate_slots`
    gives it a private copy and records the `(src, dst)` pair; `take_copies` hands the pairs of
    a step to the model runner, which copies them before storing new K/V.

    It also records, for the model runner's persistent rows, which tables changed (created,
    grown, a copy-on-write swap, a fork) and which were dropped since the last step
    (`take_changes`): a steady decode inside its last block changes nothing.

    Prefix caching (`enable_prefix_caching`): a full block is named by the SHA-256 of its
    parent block's hash and its token ids, so equal names mean equal K/V (the K/V of a token
    depends on it, every token before it and the sequence's LoRA adapter, which names the
    first block's parent). A sequence's full blocks are
    registered under their names when the scheduler allocates past them (prompt chunks,
    block boundaries) and when the sequence is freed. A registered block nobody holds is
    not forgotten: it waits, least recently released first, in `_evictable`, and counts as
    free. `cached_prefix` finds the longest run of registered blocks that starts a
    sequence's tokens, `take_prefix` gives them to it; allocation takes a never-registered
    free block first, then evicts the least recently released cached one. A block's name
    is dropped only when it is evicted; its content never changes while it has one
    (copy-on-write only ever copies a partial, hence unregistered, block).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # A stack: pop() and append() are O(1); low ids are handed out first.
        self._free_blocks = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self.block_tables: dict[int, list[int]] = {}
        self._copies: list[tuple[int, int]] = []
        self._changed: set[int] = set()
        # Per sequence, the position below which it writes into blocks it holds alone, as
        # allocate_slots last found it: a decode below it (most steps) needs no look at its
        # table. Conservative: fork drops it for both sequences.
        self._writable_end: dict[int, int] = {}
        self._freed: list[int] = []
        # Prefix cache: a registered block's name, the block of each name, the registered
        # blocks nobody holds (least recently released first), and the names of the full
        # blocks of each sequence that has a table or has been looked up.
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        self._cached_blocks: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._seq_names: dict[int, _BlockNames] = {}

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones and cached ones nobody holds."""
        return len(self._free_blocks) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, held or evictable."""
        return len(self._cached_blocks)

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
        """Blocks `allocate_slots(seq, num_new_tokens)` would take from the free list."""
        # A sequence without a table has computed nothing (start is 0): no copy-on-write.
        table = self.block_tables.get(seq.seq_id, [])
        start, block_size = seq.num_computed_tokens, self.block_size
        needed = -(-(start + num_new_tokens) // block_size) - len(table)
        if start % block_size and self.ref_counts[table[start // block_size]] > 1:
            needed += 1  # copy-on-write of a shared partial block
        return needed if needed > 0 else 0

    # -- mutations ---------------------------------------------------------------------------

    def _allocate_block(self) -> int:
        if self._free_blocks:
            block = self._free_blocks.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)  # the least recently released
            name = self._block_hashes[block]
            assert name is not None, "an evictable block is registered"
            del self._cached_blocks[name]
            self._block_hashes[block] = None
        else:
            raise NoFreeBlocksError("no free KV-cache block; allocate_slots checks first")
        self.ref_counts[block] = 1
        return block

    def _release_block(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self._block_hashes[block] is None:
                self._free_blocks.append(block)
            else:
                self._evictable[block] = None

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Makes room for the tokens [num_computed, num_computed + num_new_tokens) of `seq`;
        returns False, changing nothing, when the free blocks are too few.

        Copy-on-write happens here: a shared partial last block is replaced in this table by a
        fresh block, the pair is recorded for copying, and the old block loses one reference.
        A token that goes into a block the sequence holds alone (most decodes) changes nothing.
        """
        end = seq.num_computed_tokens + num_new_tokens
        if end <= self._writable_end.get(seq.seq_id, 0):
            return True  # full blocks it filled register when it next enters a new one
        return self._grow(seq, end, end)

    def allocate_lookahead(self, seq: Sequence, num_tokens: int) -> bool:
        """Makes room for `num_tokens` slots past the computed tokens of `seq`, where a
        draft model writes its proposals to its own cache through this table (vLLM's
        num_lookahead_tokens): as allocate_slots, but none of them is registered in the
        prefix cache before the target computes it."""
        start = seq.num_computed_tokens
        if start + num_tokens <= self._writable_end.get(seq.seq_id, 0):
            return True
        return self._grow(seq, start + num_tokens, start)

    def _grow(self, seq: Sequence, end: int, registered_end: int) -> bool:
        """Gives `seq` the blocks of its first `end` positions (copying a shared partial
        block it writes into) and registers its full blocks among the first
        `registered_end`; False, changing nothing, when the free blocks are too few."""
        start = seq.num_computed_tokens
        table = self.block_tables.setdefault(seq.seq_id, [])
        block_size = self.block_size
        target = -(-end // block_size)
        copy_on_write = start % block_size != 0 and self.ref_counts[table[start // block_size]] > 1
        needed = target - len(table) + copy_on_write
        if needed > 0:
            if needed > self.num_free_blocks:
                return False
            self._changed.add(seq.seq_id)
            if copy_on_write:
                index = start // block_size
                src = table[index]
                dst = self._allocate_block()
                table[index] = dst
                self._release_block(src)
                self._copies.append((src, dst))
            while len(table) < target:
                table.append(self._allocate_block())
        if self.enable_prefix_caching:
            self._register(seq, table, registered_end)
        self._writable_end[seq.seq_id] = len(table) * block_size
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Gives `child` its parent's table; every shared block gains one reference."""
        table = self.block_tables[parent.seq_id]
        for block in table:
            self.ref_counts[block] += 1
        self.block_tables[child.seq_id] = list(table)
        self._changed.add(child.seq_id)
        self._writable_end.pop(parent.seq_id, None)  # its last block is shared now
        names = self._seq_names.get(parent.seq_id)
        if names is not None:  # their full blocks are the same
            self._seq_names[child.seq_id] = _BlockNames(list(names.names), names.num_registered)

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s table; blocks nobody else holds go back to the free list (with
        prefix caching, its computed full blocks are registered first and wait as evictable;
        the last blocks are released first, so they are evicted before the first)."""
        table = self.block_tables.pop(seq.seq_id, None)
        self._writable_end.pop(seq.seq_id, None)
        if table is not None:  # else it was only looked up while it waited
            self._changed.discard(seq.seq_id)
            self._freed.append(seq.seq_id)
            if self.enable_prefix_caching:
                self._register(seq, table, seq.num_computed_tokens)
            for block in reversed(table):
                self._release_block(block)
        self._seq_names.pop(seq.seq_id, None)

    # -- prefix cache ------------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The registered blocks that hold the longest prefix of `seq`'s tokens made of full
        blocks, leaving at least its last token to compute (its logits are needed). Takes
        nothing: `take_prefix` does. Empty without prefix caching."""
        if not self.enable_prefix_caching:
            return []
        names = self._names(seq, (len(seq.token_ids) - 1) // self.block_size).names
        blocks = []
        for name in names:
            block = self._cached_blocks.get(name)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def take_prefix(self, seq: Sequence, blocks: list[int]) -> None:
        """Makes `blocks` (from `cached_prefix`) the start of `seq`'s table, which it must not
        have yet; the caller sets `seq.num_computed_tokens` past them. An evictable block
        leaves the LRU list."""
        assert seq.seq_id not in self.block_tables, "a prefix starts a new table"
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1
        self.block_tables[seq.seq_id] = list(blocks)
        self._changed.add(seq.seq_id)

    def release_prefix(self, seq: Sequence) -> None:
        """Undoes `take_prefix` before anything was computed into `seq`'s table: its blocks
        go back to where they were, without registering or reporting anything."""
        table = self.block_tables.pop(seq.seq_id)
        self._changed.discard(seq.seq_id)
        for block in table:
            self._release_block(block)

    def _names(self, seq: Sequence, num_blocks: int) -> _BlockNames:
        """`seq`'s block names, at least its first `num_blocks` (each computed once)."""
        entry = self._seq_names.setdefault(seq.seq_id, _BlockNames())
        names = entry.names
        tokens, size = seq.token_ids, self.block_size
        parent = names[-1] if names else root_hash(seq.lora_int_id)
        for index in range(len(names), num_blocks):
            block_tokens = array(TOKEN_TYPECODE, tokens[index * size : (index + 1) * size])
            parent = hashlib.sha256(parent + block_tokens.tobytes()).digest()
            names.append(parent)
        return entry

    def _register(self, seq: Sequence, table: list[int], num_computed: int) -> None:
        """Registers the full blocks of `seq` whose every token is known and computed (or
        scheduled) in its first `num_computed` positions. A name already registered keeps
        its block: the same content computed twice is cached once."""
        num_full = min(num_computed, len(seq.token_ids)) // self.block_size
        entry = self._seq_names.get(seq.seq_id)
        if entry is not None and num_full <= entry.num_registered:
            return  # no block filled since the last call (a decode in its last block)
        entry = self._names(seq, num_full)
        names, hashes, cached = entry.names, self._block_hashes, self._cached_blocks
        for index in range(entry.num_registered, num_full):
            block = table[index]
            if hashes[block] is None and names[index] not in cached:
                hashes[block] = names[index]
                cached[names[index]] = block
        entry.num_registered = max(entry.num_registered, num_full)

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
        evictable = set(self._evictable)
        assert len(free) == len(self._free_blocks), "a block is on the free list twice"
        assert not free & evictable, "a block is both free and evictable"
        unused = free | evictable  # built once: the loop below asks it for every block
        assert NULL_BLOCK not in unused and holders[NULL_BLOCK] == 0, "null block used"
        registered = set(self._cached_blocks.values())
        assert len(registered) == len(self._cached_blocks), "a block has two names"
        used = sum(1 for b in range(1, self.num_blocks) if holders[b] > 0)
        assert len(free) + len(evictable) + used == self.num_usable_blocks, "free + used != all"
        for block in range(1, self.num_blocks):
            assert self.ref_counts[block] == holders[block], (
                f"block {block}: ref count {self.ref_counts[block]} != {holders[block]} holders"
            )
            assert not (block in unused and holders[block]), f"free {block} is held"
            name = self._block_hashes[block]
            assert (name is None) == (block not in registered), (
                f"block {block}: registered in one map only"
            )
            assert name is None or self._cached_blocks[name] == block, f"block {block}: name"
            assert block not in free or name is None, f"free block {block} is registered"
            assert block not in evictable or name is not None, f"unregistered {block} evictable"
        assert self.enable_prefix_caching or not self._cached_blocks, "cached while disabled"
        for seq_id, end in self._writable_end.items():
            if end == 0:
                continue
            table = self.block_tables[seq_id]
            assert end <= len(table) * self.block_size, f"sequence {seq_id} writes past its table"
            last = table[(end - 1) // self.block_size]
            assert self.ref_counts[last] == 1, f"sequence {seq_id} would write a shared block"
