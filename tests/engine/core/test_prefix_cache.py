"""The BlockManager's prefix cache with exact block ids at tiny sizes: hits, partial hits,
eviction order, a hit on an evictable block, forks of cached blocks; invariants after every
operation, and every block free or cached at the end."""

import hashlib
from array import array

from octavo.engine.core.block_manager import ROOT_HASH, BlockManager
from octavo.engine.core.sequence import Sequence

BLOCK = 4


def seq_of(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens))


def compute(bm: BlockManager, seq: Sequence, num_new: int) -> None:
    """What a step does: make room, then count the tokens as computed."""
    assert bm.allocate_slots(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.check_invariants()


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """What admission does: take the cached prefix, skip its tokens; returns the hit."""
    blocks = bm.cached_prefix(seq)
    bm.take_prefix(seq, blocks)
    seq.num_computed_tokens = len(blocks) * bm.block_size
    bm.check_invariants()
    return blocks


def free(bm: BlockManager, *seqs: Sequence) -> None:
    for seq in seqs:
        bm.free(seq)
        bm.check_invariants()


def all_back(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_usable_blocks and not bm.block_tables


TOKENS = list(range(100, 118))  # 18 tokens: 4 full blocks and 2 more


def test_a_freed_prompt_is_found_again_block_for_block():
    bm = BlockManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    first = seq_of(0, TOKENS)
    assert admit(bm, first) == []
    compute(bm, first, 18)
    assert bm.get_block_table(first) == [1, 2, 3, 4, 5]
    assert bm.num_cached_blocks == 4  # full blocks are registered as they are scheduled
    free(bm, first)
    assert bm.num_free_blocks == 15  # cached blocks nobody holds count as free
    again = seq_of(1, TOKENS)
    assert admit(bm, again) == [1, 2, 3, 4] and again.num_computed_tokens == 16
    compute(bm, again, 2)
    # The partial block 5 was not registered: freed, and handed out again like any block.
    assert bm.get_block_table(again) == [1, 2, 3, 4, 5]
    free(bm, again)
    all_back(bm)


def test_the_last_token_is_always_computed():
    bm = BlockManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    first = seq_of(0, TOKENS[:16])
    compute(bm, first, 16)
    free(bm, first)
    same = seq_of(1, TOKENS[:16])  # 4 full blocks: the fourth holds the token to compute
    assert admit(bm, same) == [1, 2, 3]
    free(bm, same)
    all_back(bm)


def test_a_partial_hit_stops_at_the_first_different_block_and_names_chain():
    bm = BlockManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    first = seq_of(0, TOKENS)
    compute(bm, first, 18)
    # Same second block's tokens but a different first block: no hit at all (the name of a
    # block includes its prefix).
    moved = seq_of(1, [7, 7, 7, 7, *TOKENS[4:]])
    assert admit(bm, moved) == []
    # The first 9 tokens shared: two full blocks hit while `first` still holds them.
    branch = seq_of(2, [*TOKENS[:9], 1, 2, 3, 4, 5, 6])
    assert admit(bm, branch) == [1, 2]
    assert bm.ref_counts[1] == bm.ref_counts[2] == 2
    compute(bm, branch, 15 - 8)
    free(bm, first, moved, branch)
    all_back(bm)


def test_block_names_are_sha256_of_the_parent_name_and_tokens():
    bm = BlockManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    seq = seq_of(0, TOKENS[:9])
    compute(bm, seq, 9)
    first = hashlib.sha256(ROOT_HASH + array("i", TOKENS[:4]).tobytes()).digest()
    second = hashlib.sha256(first + array("i", TOKENS[4:8]).tobytes()).digest()
    assert bm._cached_blocks == {first: 1, second: 2}
    free(bm, seq)


def test_a_block_is_found_only_by_every_bit_of_its_tokens_in_order():
    """What the names stand for, seen through lookups: each token's every bit (32-bit ids),
    their order within the block, and the whole prefix before it."""
    bm = BlockManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    seq = seq_of(0, TOKENS[:9])
    compute(bm, seq, 9)  # blocks 1, 2 full and cached
    looked_up = {
        (TOKENS[1], TOKENS[0], *TOKENS[2:9]): [],  # the first block's tokens swapped
        (TOKENS[0] + (1 << 16), *TOKENS[1:9]): [],  # a token that differs above 16 bits
        (*TOKENS[:4], TOKENS[5], TOKENS[4], *TOKENS[6:9]): [1],  # the second's swapped
        (*TOKENS[:7], TOKENS[7] + (1 << 24), TOKENS[8]): [1],
        tuple(TOKENS[:9]): [1, 2],
    }
    for i, (tokens, hit) in enumerate(looked_up.items(), start=1):
        other = seq_of(i, list(tokens))
        assert bm.cached_prefix(other) == hit, tokens
        free(bm, other)
    free(bm, seq)
    all_back(bm)


def test_eviction_takes_never_cached_blocks_first_then_the_least_recently_released():
    bm = BlockManager(num_blocks=9, block_size=BLOCK, enable_prefix_caching=True)  # 8 usable
    a, b = seq_of(0, TOKENS[:8]), seq_of(1, [*range(200, 208)])
    compute(bm, a, 8)  # blocks 1, 2
    compute(bm, b, 8)  # blocks 3, 4
    free(bm, a)  # released last block first: 2 then 1
    free(bm, b)  # then 4, 3
    # Blocks 5..8 were never registered: taken first, lowest first.
    c = seq_of(2, [*range(300, 316)])
    compute(bm, c, 16)
    assert bm.get_block_table(c) == [5, 6, 7, 8]
    # Then evictions, least recently released first: 2, 1 (a's, tail first), then 4.
    d = seq_of(3, [*range(400, 412)])
    compute(bm, d, 12)
    assert bm.get_block_table(d) == [2, 1, 4]
    assert bm.num_cached_blocks == 4 + 3 + 1  # c's 4, d's 3 (new names), b's block 3
    again_b = seq_of(4, [*range(200, 208), 9])
    assert admit(bm, again_b) == [3]  # b's first block is left, its second (4) is gone
    again_a = seq_of(5, [*TOKENS[:8], 9])
    assert admit(bm, again_a) == []
    free(bm, c, d, again_b, again_a)
    all_back(bm)


def test_a_hit_on_an_evictable_block_takes_it_out_of_the_lru():
    bm = BlockManager(num_blocks=5, block_size=BLOCK, enable_prefix_caching=True)  # 4 usable
    a = seq_of(0, TOKENS[:8])
    compute(bm, a, 8)  # blocks 1, 2
    free(bm, a)  # both evictable, 2 before 1
    b = seq_of(1, [*TOKENS[:4], 50, 51, 52])  # hits block 1 (evictable)
    assert admit(bm, b) == [1]
    assert bm.num_free_blocks == 3  # 3, 4 and the evictable 2
    compute(bm, b, 3)
    assert bm.get_block_table(b) == [1, 3]
    # Two more blocks: 4 (never registered), then 2 is evicted; 1, held by b, is not.
    c = seq_of(2, [*range(500, 508)])
    compute(bm, c, 8)
    assert bm.get_block_table(c) == [4, 2]
    assert bm.num_free_blocks == 0
    free(bm, b, c)
    all_back(bm)


def test_a_prefix_that_does_not_fit_is_given_back_untouched():
    bm = BlockManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    a = seq_of(0, TOKENS[:8])
    compute(bm, a, 8)
    free(bm, a)
    bm.take_changes()
    b = seq_of(1, [*TOKENS[:8], 1])
    assert admit(bm, b) == [1, 2]
    bm.release_prefix(b)
    bm.check_invariants()
    assert bm.take_changes() == (set(), [])  # the runner never hears of it
    assert bm.num_free_blocks == 7 and bm.num_cached_blocks == 2
    assert admit(bm, b) == [1, 2]
    free(bm, b)
    all_back(bm)


def test_forked_samples_share_cached_blocks_and_register_their_own():
    bm = BlockManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    parent = seq_of(0, TOKENS[:10])
    compute(bm, parent, 10)  # blocks 1, 2 full and cached, 3 partial
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    bm.check_invariants()
    assert bm.ref_counts[1:4] == [2, 2, 2]
    # Each appends its own tokens: the shared partial block 3 is copied on write.
    for seq, token in ((parent, 61), (child, 62)):
        seq.token_ids += [token, token]
        compute(bm, seq, 2)
    assert bm.take_copies() == [(3, 4)]
    assert bm.get_block_table(parent) == [1, 2, 4] and bm.get_block_table(child) == [1, 2, 3]
    # Their third blocks differ and are both full now: two names, both registered on free.
    free(bm, parent, child)
    assert bm.num_cached_blocks == 4
    for token in (61, 62):
        looked = seq_of(9, [*TOKENS[:10], token, token, 0])  # 3 full blocks, then 1
        assert len(admit(bm, looked)) == 3
        free(bm, looked)
    all_back(bm)


def test_the_same_content_computed_twice_is_cached_once():
    bm = BlockManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    a, b = seq_of(0, TOKENS[:8]), seq_of(1, TOKENS[:8])
    compute(bm, a, 8)  # no lookup for b: both compute the prompt (say, both score it)
    compute(bm, b, 8)
    assert bm.num_cached_blocks == 2
    free(bm, a, b)  # b's copies are plain free blocks again
    assert bm.num_cached_blocks == 2
    # Never registered, b's blocks 3 and 4 are handed out before any cached block is
    # evicted: all 13 plain free blocks go to a new sequence, and a's blocks stay cached.
    other = seq_of(2, [*range(600, 652)])  # 13 full blocks
    compute(bm, other, 52)
    assert bm.get_block_table(other) == [3, 4, *range(5, 16)]
    assert bm.num_free_blocks == 2 and bm.num_cached_blocks == 2 + 13
    assert bm.cached_prefix(seq_of(3, [*TOKENS[:8], 9])) == [1, 2]
    free(bm, other)
    all_back(bm)


def test_without_prefix_caching_nothing_is_kept():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    a = seq_of(0, TOKENS)
    compute(bm, a, 18)
    free(bm, a)
    assert bm.num_cached_blocks == 0 and bm.cached_prefix(seq_of(1, TOKENS)) == []
    all_back(bm)


def test_a_waiting_sequence_that_is_aborted_leaves_nothing():
    bm = BlockManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    waiting = seq_of(0, TOKENS)
    assert bm.cached_prefix(waiting) == []  # looked up (names computed), never admitted
    bm.free(waiting)
    all_back(bm)
    # Its block names went with it: once the same tokens are cached, a new sequence of the
    # same id but other tokens finds nothing (the names of a sequence outliving it would
    # find the old tokens' blocks).
    computed = seq_of(1, TOKENS)
    compute(bm, computed, 18)
    other, same = seq_of(0, [*range(700, 718)]), seq_of(2, TOKENS)
    assert bm.cached_prefix(other) == [] and bm.cached_prefix(same) == [1, 2, 3, 4]
    free(bm, computed, other, same)
    all_back(bm)


def test_lookahead_slots_are_not_cached_before_the_target_computes_them():
    """A draft model's lookahead: slots past the computed tokens, the last sampled token's
    included. Its blocks are the sequence's, but none of them is registered until the target
    computes its tokens: a request that ends before then leaves no block named for tokens
    whose K/V the cache never got."""
    bm = BlockManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    seq = seq_of(0, TOKENS[:8])  # 2 full blocks once its last token (position 7) is computed
    compute(bm, seq, 7)
    assert bm.allocate_lookahead(seq, 3)  # positions 7..9
    bm.check_invariants()
    assert bm.get_block_table(seq) == [1, 2, 3]
    assert bm.num_cached_blocks == 1  # block 2 waits for position 7
    assert bm.allocate_lookahead(seq, 2)  # within the slots it has: nothing changes
    assert bm.get_block_table(seq) == [1, 2, 3] and bm.num_free_blocks == 12
    free(bm, seq)
    other = seq_of(1, TOKENS[:8] + [1])
    assert admit(bm, other) == [1]
    free(bm, other)
    all_back(bm)


def test_lookahead_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=BLOCK, enable_prefix_caching=False)
    seq = seq_of(0, TOKENS[:6])
    compute(bm, seq, 5)
    assert not bm.allocate_lookahead(seq, 12)  # 5 blocks; 3 usable
    assert bm.get_block_table(seq) == [1, 2] and bm.num_free_blocks == 1
    free(bm, seq)
    all_back(bm)
