import pytest

from specdec.block_manager import BlockManager, NoFreeBlocksError
from specdec.config import SamplingParams
from specdec.sequence import Sequence


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, list(tokens), len(tokens), SamplingParams())


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.allocate(seq, 12)  # still fits in three blocks
    assert len(seq.block_table) == 3
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_allocation_beyond_the_pool_raises_and_keeps_state():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(10)))
    assert not bm.can_allocate(seq, 10)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(seq, 10)
    assert bm.num_free_blocks == 2 and seq.block_table == []


def test_prefix_cache_shares_full_blocks_and_keeps_last_token_uncached():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_seq(list(range(12)))
    bm.allocate(first, 12)
    first.num_computed_tokens = 12
    bm.register_full_blocks(first)
    second = make_seq(list(range(12)), seq_id=1)
    bm.match_prefix(second)
    # 12 tokens = 3 full blocks, but the last token must be recomputed: 2 blocks are reused.
    assert second.block_table == first.block_table[:2]
    assert second.num_computed_tokens == 8
    assert bm.ref_counts[first.block_table[0]] == 2
    bm.free(first)
    bm.free(second)
    assert bm.num_free_blocks == 8


def test_freed_cached_block_is_revived_then_evicted_when_reused():
    bm = BlockManager(num_blocks=3, block_size=2)
    seq = make_seq([5, 6, 7])
    bm.allocate(seq, 3)
    seq.num_computed_tokens = 3
    bm.register_full_blocks(seq)
    cached_block = seq.block_table[0]
    bm.free(seq)
    again = make_seq([5, 6, 9], seq_id=1)
    bm.match_prefix(again)
    assert again.block_table == [cached_block] and bm.num_free_blocks == 2
    bm.free(again)
    hog = make_seq(list(range(6)), seq_id=2)
    bm.allocate(hog, 6)  # takes every block, evicting the cached one
    assert not bm.cached_blocks
    bm.free(hog)
    fresh = make_seq([5, 6, 9], seq_id=3)
    bm.match_prefix(fresh)
    assert fresh.block_table == [] and fresh.num_computed_tokens == 0


def test_different_prefixes_do_not_share_blocks():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.register_full_blocks(a)
    b = make_seq([1, 2, 9, 4, 5], seq_id=1)
    bm.match_prefix(b)
    assert b.block_table == [a.block_table[0]]  # only the first block matches
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_reset_prefix_cache_forgets_free_blocks_and_keeps_held_ones():
    bm = BlockManager(num_blocks=8, block_size=4)
    held, freed = make_seq(list(range(9))), make_seq(list(range(100, 109)), seq_id=1)
    for seq in (held, freed):
        bm.allocate(seq, 9)
        seq.num_computed_tokens = 9
        bm.register_full_blocks(seq)
    bm.free(freed)
    bm.reset_prefix_cache()
    again = make_seq(list(range(100, 109)), seq_id=2)
    bm.match_prefix(again)
    assert again.block_table == [] and again.num_computed_tokens == 0
    twin = make_seq(list(range(9)), seq_id=3)
    bm.match_prefix(twin)  # `held` still holds its blocks: they stay shared
    assert twin.block_table == held.block_table[:2]
