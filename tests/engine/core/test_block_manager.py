"""BlockManager with exact block ids at tiny sizes; invariants after every operation."""

import pytest

from octavo.engine.core.block_manager import NULL_BLOCK, BlockManager
from octavo.engine.core.sequence import Sequence


def make_seq(seq_id: int, num_tokens: int) -> Sequence:
    return Sequence(seq_id, list(range(1, num_tokens + 1)))


def compute(bm: BlockManager, seq: Sequence, num_new: int) -> None:
    """What a step does: make room, then count the tokens as computed."""
    assert bm.allocate_slots(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.check_invariants()


def test_allocation_uses_lowest_free_blocks_and_never_the_null_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(0, 6), make_seq(1, 3)
    compute(bm, a, 6)
    compute(bm, b, 3)
    assert bm.get_block_table(a) == [1, 2]
    assert bm.get_block_table(b) == [3]
    assert bm.num_free_blocks == 4 and NULL_BLOCK not in bm.get_block_table(a)
    # Two more tokens for a: position 6, 7 still fit in block 2; position 8 opens block 4.
    compute(bm, a, 2)
    assert bm.get_block_table(a) == [1, 2]
    compute(bm, a, 1)
    assert bm.get_block_table(a) == [1, 2, 4]
    bm.free(a)
    bm.check_invariants()
    bm.free(b)
    bm.check_invariants()
    assert bm.num_free_blocks == 7 and bm.usage == 0.0


def test_chunked_allocation_counts_blocks_exactly():
    bm = BlockManager(num_blocks=6, block_size=4)
    seq = make_seq(0, 17)
    assert bm.num_new_blocks_needed(seq, 5) == 2
    compute(bm, seq, 5)
    assert bm.num_new_blocks_needed(seq, 3) == 0  # positions 5..7 fit in block 2
    assert bm.num_new_blocks_needed(seq, 12) == 3
    # 20 tokens: 5 blocks, all the usable ones.
    assert bm.num_new_blocks_needed(seq, 15) <= bm.num_free_blocks
    assert bm.num_new_blocks_needed(seq, 16) > bm.num_free_blocks
    free, table = bm.num_free_blocks, list(bm.get_block_table(seq))
    assert not bm.allocate_slots(seq, 17)  # refused whole: nothing taken
    assert bm.num_free_blocks == free and bm.get_block_table(seq) == table
    bm.check_invariants()


def test_fork_shares_blocks_and_copy_on_write_copies_only_the_partial_last_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(0, 6)
    compute(bm, parent, 6)  # blocks [1, 2]; block 2 holds positions 4, 5
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    bm.check_invariants()
    assert bm.get_block_table(child) == [1, 2]
    assert bm.ref_counts[1] == 2 and bm.ref_counts[2] == 2
    child.token_ids.append(7)
    parent.token_ids.append(8)
    # The child writes position 6 into shared block 2: it gets block 3, a copy of block 2.
    assert bm.num_new_blocks_needed(child, 1) == 1
    compute(bm, child, 1)
    assert bm.get_block_table(child) == [1, 3]
    assert bm.take_copies() == [(2, 3)]
    assert bm.take_copies() == []
    # The parent is now block 2's only holder: it writes in place, nothing is copied.
    assert bm.num_new_blocks_needed(parent, 1) == 0
    compute(bm, parent, 1)
    assert bm.get_block_table(parent) == [1, 2]
    assert bm.take_copies() == []
    assert bm.ref_counts[1] == 2
    bm.free(parent)
    bm.check_invariants()
    assert bm.ref_counts[1] == 1 and bm.ref_counts[2] == 0
    bm.free(child)
    bm.check_invariants()
    assert bm.num_free_blocks == 7


def test_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(0, 8)
    compute(bm, parent, 8)  # [1, 2], both full
    children = []
    for seq_id in (1, 2, 3):
        child = parent.fork(seq_id, seq_id)
        bm.fork(parent, child)
        bm.check_invariants()
        children.append(child)
    for i, child in enumerate(children):
        child.token_ids.append(100 + i)
        compute(bm, child, 1)
    assert [bm.get_block_table(c) for c in children] == [[1, 2, 3], [1, 2, 4], [1, 2, 5]]
    assert bm.take_copies() == []
    assert bm.ref_counts[1] == 4
    for seq in (parent, *children):
        bm.free(seq)
        bm.check_invariants()
    assert bm.num_free_blocks == 7


def test_freeing_an_unknown_sequence_is_a_no_op_and_invariants_catch_corruption():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq(0, 3)
    bm.free(seq)
    compute(bm, seq, 3)
    bm.ref_counts[1] += 1  # corrupt: one more reference than holders
    with pytest.raises(AssertionError, match="ref count"):
        bm.check_invariants()


def test_invariants_catch_a_held_block_on_the_free_list():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = make_seq(0, 3)
    compute(bm, seq, 3)  # holds blocks 1 and 2; block 3 is free
    held = bm.block_tables[seq.seq_id][0]
    bm._free_blocks = [held]  # corrupt: the counts still add up, but a held block is free
    with pytest.raises(AssertionError, match=f"free {held} is held"):
        bm.check_invariants()


def test_block_manager_rejects_too_few_blocks():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=1, block_size=4)


def test_take_changes_reports_exactly_the_tables_that_changed_and_those_dropped():
    """What the runner's persistent rows rely on: a decode inside its own last block is no
    change; a new table, a new block, a fork and a copy-on-write swap are; a free is a drop."""
    bm = BlockManager(num_blocks=12, block_size=4)
    a = make_seq(0, 6)
    compute(bm, a, 6)  # a new table of two blocks
    assert bm.take_changes() == ({0}, [])
    compute(bm, a, 1)  # position 6: inside block 2, held alone
    assert bm.num_new_blocks_needed(a, 1) == 0 and bm.take_changes() == (set(), [])
    b = make_seq(1, 7)
    b.num_computed_tokens = 7  # a's tokens, as Sequence.fork copies them
    bm.fork(a, b)
    assert bm.take_changes() == ({1}, [])
    assert bm.num_new_blocks_needed(b, 1) == 1  # its last block is shared: copy-on-write
    compute(bm, b, 1)  # copy-on-write swaps b's last block
    assert bm.take_changes() == ({1}, []) and bm.take_copies() == [(2, 3)]
    compute(bm, a, 2)  # positions 7 and 8: the second opens a new block
    assert bm.take_changes() == ({0}, [])
    bm.free(b)
    c = make_seq(2, 2)
    compute(bm, c, 2)
    bm.free(c)  # created and dropped within one step: only the drop is reported
    assert bm.take_changes() == (set(), [1, 2])
