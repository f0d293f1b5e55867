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


def finished(tokens: list[int], computed: int, bm: BlockManager, seq_id: int = 0) -> Sequence:
    """A sequence with ``computed`` of its tokens in the cache, then freed (as at its end)."""
    seq = make_seq(tokens, seq_id)
    bm.allocate(seq, len(tokens))
    seq.num_computed_tokens = computed
    bm.register_full_blocks(seq)
    return seq


def test_a_freed_partial_block_is_copied_for_sequences_that_continue_it():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = finished(list(range(11)), 10, bm)  # 2 full blocks and 2 computed tokens
    blocks = list(parent.block_table)
    bm.free(parent)
    child = make_seq(list(range(11)), seq_id=1)  # the parent's tokens, its last one new
    bm.match_prefix(child)
    assert child.block_table[:2] == blocks[:2] and child.block_table[2] != blocks[2]
    assert child.num_computed_tokens == 10 and child.metrics.num_cached_tokens == 10
    copies = bm.take_copies()
    assert copies == [(blocks[2], child.block_table[2])] and bm.take_copies() == []
    assert bm.ref_counts[blocks[2]] == 1  # held until the copy is made
    bm.release_copies(copies)
    assert bm.ref_counts[blocks[2]] == 0 and blocks[2] in bm.free_blocks
    # a longer continuation takes the cached run too; one that differs inside it takes less
    longer = make_seq([*range(10), 77, 78, 79], seq_id=2)
    bm.match_prefix(longer)
    assert longer.num_computed_tokens == 10
    other = make_seq([0, 1, 2, 3, 4, 5, 6, 7, 8, 99, 5], seq_id=3)
    bm.match_prefix(other)
    assert other.num_computed_tokens == 8  # full blocks only: no cached run of [8, 99]
    bm.release_copies(bm.take_copies())
    for seq in (child, longer, other):
        bm.free(seq)
    assert bm.num_free_blocks == 8


def test_a_partial_block_freed_before_its_copy_is_not_cached_and_nothing_leaks():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.free(finished(list(range(7)), 6, bm))
    child = make_seq(list(range(7)), seq_id=1)
    bm.match_prefix(child)
    assert child.num_computed_tokens == 6
    empty = child.block_table[1]
    bm.free(child)  # as when its admission fails: the copy is dropped, the source let go
    assert bm.take_copies() == [] and bm.block_hash[empty] is None
    assert bm.num_free_blocks == 8 and all(r == 0 for r in bm.ref_counts)
    # tokens not computed are not cached; nor is a block without a free one for the copy
    bm.free(finished(list(range(20, 27)), 4, bm, seq_id=2))
    late = make_seq(list(range(20, 27)), seq_id=3)
    bm.match_prefix(late)
    assert late.num_computed_tokens == 4 and bm.take_copies() == []
    bm.free(late)
    tight = BlockManager(num_blocks=2, block_size=4)
    tight.free(finished(list(range(7)), 6, tight))
    holder = make_seq(list(range(30, 34)), seq_id=4)
    tight.allocate(holder, 4)  # one block left free: the cached one itself
    again = make_seq(list(range(7)), seq_id=5)
    tight.match_prefix(again)
    assert again.num_computed_tokens == 4 and tight.take_copies() == []


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_counts_and_contents_right(seed):
    """Random sequences (continuations of earlier ones among them) admitted, computed and freed
    against a small pool: after every operation each block's reference count is its holders
    (sequences and pending copies' sources), the free list is exactly the unheld blocks, and
    every position a sequence counts as computed holds its own token in the "K/V" written so
    far (copies included): what a hit or a copy hands over is what the request would compute."""
    import random

    rng = random.Random(seed)
    bs, num_blocks = 4, 24
    bm = BlockManager(num_blocks=num_blocks, block_size=bs)
    kv: dict[tuple[int, int], int] = {}  # (block, slot) -> the token whose K/V is there
    done: list[list[int]] = []  # token lists of freed sequences, to continue
    live: list[Sequence] = []
    taken: list[tuple[int, int]] = []  # copies handed out, not yet made

    def check() -> None:
        pending = {**bm.copies, **{target: source for source, target in taken}}
        holders = [0] * num_blocks
        for seq in live:
            for block in seq.block_table:
                holders[block] += 1
        for source in pending.values():
            holders[source] += 1
        assert bm.ref_counts == holders
        assert set(bm.free_blocks) == {b for b in range(num_blocks) if holders[b] == 0}
        for seq in live:
            for pos in range(seq.num_computed_tokens):
                block = seq.block_table[pos // bs]
                if block not in pending:  # a pending copy is made before the forward
                    assert kv.get((block, pos % bs)) == seq.token_ids[pos], (seq.seq_id, pos)

    for step in range(400):
        if live and (rng.random() < 0.3 or bm.num_free_blocks < 2):
            seq = live.pop(rng.randrange(len(live)))
            computed = rng.randint(max(0, seq.num_computed_tokens), seq.num_tokens)
            for pos in range(seq.num_computed_tokens, computed):  # computes some, then ends
                kv[(seq.block_table[pos // bs], pos % bs)] = seq.token_ids[pos]
            seq.num_computed_tokens = computed
            bm.register_full_blocks(seq)
            done.append(seq.token_ids[: computed + 1])
            bm.free(seq)
        else:
            if done and rng.random() < 0.7:  # continue (or diverge from) an earlier sequence
                base = rng.choice(done)
                cut = rng.randint(1, len(base))
                tokens = base[:cut] + [rng.randrange(5) for _ in range(rng.randint(1, 6))]
            else:
                tokens = [rng.randrange(5) for _ in range(rng.randint(2, 30))]
            seq = make_seq(tokens, seq_id=step)
            bm.match_prefix(seq)
            assert seq.num_computed_tokens < seq.num_tokens  # the last token is computed
            if not bm.can_allocate(seq, seq.num_tokens):
                bm.free(seq)  # as admission gives its hits back
                check()
                continue
            bm.allocate(seq, seq.num_tokens)
            live.append(seq)
            copies = taken[:] = bm.take_copies()
            check()
            for source, target in copies:  # the runner's copy, then the sources let go
                for slot in range(bs):
                    if (source, slot) in kv:
                        kv[(target, slot)] = kv[(source, slot)]
                    else:
                        kv.pop((target, slot), None)
            bm.release_copies(copies)
            taken.clear()
        check()
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)
