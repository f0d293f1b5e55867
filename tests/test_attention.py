"""Paged attention in a mixed step: fresh prompts, decodes, verifications and a later prompt chunk.

A step's sequences are grouped so that a decode is never padded to a prompt chunk's width (a
32-request mix once spent 25 of 33 s in SDPA over such padding): decodes and verifications share
one group, each wider chunk with a cached prefix is a group of its own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.attention import NARROW_QUERY, AttentionMetadata, paged_attention

BLOCK = 4
HEADS, KV_HEADS, DIM = 6, 2, 16


def tables_for(context_lens: list[int]) -> list[list[int]]:
    tables, first = [], 0
    for n in context_lens:
        tables.append(list(range(first, first + -(-n // BLOCK))))
        first += len(tables[-1])
    return tables


def slots(table: list[int], start: int, end: int) -> list[int]:
    return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]


def build(query_lens: list[int], context_lens: list[int], invariant: bool) -> AttentionMetadata:
    tables = tables_for(context_lens)
    step = [s for t, q, c in zip(tables, query_lens, context_lens) for s in slots(t, c - q, c)]
    return AttentionMetadata.build(
        query_lens, context_lens, tables, torch.tensor(step), BLOCK, invariant
    )


@pytest.mark.parametrize("invariant", [False, True])
def test_a_prompt_chunk_is_not_padded_with_the_decodes(invariant: bool) -> None:
    # a fresh prompt, two decodes, a verification of 8 drafts, a chunk of 300 after 500 cached
    meta = build([40, 1, 1, 9, 300], [40, 77, 120, 60, 800], invariant)
    widths = sorted(tuple(g.query_index.shape) for g in meta.groups)  # [G, Q] of each group
    assert widths == ([(1, 300), (3, 9)] if not invariant else [(1, 40), (1, 300), (3, 9)])
    assert all(w <= NARROW_QUERY or g == 1 for g, w in widths)
    assert meta.fresh_ranges == ([(0, 40)] if not invariant else [])


@pytest.mark.parametrize("invariant", [False, True])
def test_mixed_step_equals_causal_attention_per_sequence(invariant: bool) -> None:
    """Every query of a mixed step attends exactly as causal attention over its whole sequence."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if invariant else torch.float32
    query_lens, context_lens = [40, 1, 9, 300, 20], [40, 77, 60, 800, 35]
    meta = build(query_lens, context_lens, invariant)
    blocks = sum(-(-c // BLOCK) for c in context_lens)
    caches = [torch.zeros(blocks, BLOCK, KV_HEADS, DIM, dtype=dtype) for _ in range(2)]
    full = [
        [torch.randn(c, h, DIM).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS)]
        for c in context_lens
    ]
    for (_, k, v), table, n, c in zip(full, tables_for(context_lens), query_lens, context_lens):
        cached = torch.tensor(slots(table, 0, c - n), dtype=torch.long)  # earlier: in the cache
        caches[0].view(-1, KV_HEADS, DIM)[cached] = k[: c - n]
        caches[1].view(-1, KV_HEADS, DIM)[cached] = v[: c - n]
    q = torch.cat([f[0][c - n :] for f, n, c in zip(full, query_lens, context_lens)])
    k = torch.cat([f[1][c - n :] for f, n, c in zip(full, query_lens, context_lens)])
    v = torch.cat([f[2][c - n :] for f, n, c in zip(full, query_lens, context_lens)])
    out = paged_attention(q, k, v, *caches, meta, DIM**-0.5).split(query_lens)
    for (fq, fk, fv), got, n, c in zip(full, out, query_lens, context_lens):
        expected = F.scaled_dot_product_attention(
            fq.float().transpose(0, 1),
            fk.float().transpose(0, 1),
            fv.float().transpose(0, 1),
            is_causal=True,
            enable_gqa=True,
        ).transpose(0, 1)[c - n :]
        tol = 2e-2 if invariant else 1e-5
        torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("invariant", [False, True])
def test_a_query_groups_indices_are_what_each_query_sees(invariant: bool) -> None:
    """Every index tensor of a group of a decode, a verification and a padded neighbour, spelled
    out query by query: the row it reads, the slots of its keys, the keys its mask lets it see;
    contiguous int64 (bool for the mask), as the C++ kernel takes them."""
    query_lens, context_lens = [1, 4, 2], [9, 6, 13]
    group = build(query_lens, context_lens, invariant).groups[0]
    tables = tables_for(context_lens)
    width = group.key_slots.shape[1]
    assert width >= max(context_lens) and (not invariant or width % 64 == 0)
    first = 0
    for g, (q, c) in enumerate(zip(query_lens, context_lens)):
        padded = [tables[g][p // BLOCK] * BLOCK + p % BLOCK for p in range(c)]
        assert group.key_slots[g, :c].tolist() == padded
        for j in range(group.query_index.shape[1]):
            assert group.query_index[g, j] == (first + j if j < q else 0)
            seen = (
                [p <= c - q + j for p in range(width)] if j < q else [p == 0 for p in range(width)]
            )
            assert group.mask is not None and group.mask[g, 0, j].tolist() == seen
        first += q
    assert group.valid_index.tolist() == list(range(sum(query_lens)))
    assert group.valid_rows.tolist() == [0, 4, 5, 6, 7, 8, 9]
    assert group.query_lens.tolist() == query_lens and group.context_lens.tolist() == context_lens
    assert group.max_start == 11
    for t in (group.query_index, group.key_slots, group.valid_index, group.valid_rows):
        assert t.dtype == torch.int64 and t.is_contiguous()
    assert group.mask.dtype == torch.bool and group.mask.is_contiguous()
