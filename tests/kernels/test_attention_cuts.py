"""The CPU attention kernel cuts a call into work items by what it holds and how many threads
share it; a query's output must be the same bits under every cut."""

from __future__ import annotations

import pytest
import torch

from specdec.attention import QueryGroup
from tests.kernels.test_cpu_ops import ext, needs_kernels


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_attention_rows_do_not_depend_on_how_the_work_is_cut(dtype: torch.dtype) -> None:
    """The kernel cuts a call into work items by how much it holds and how many threads share
    it: one query head per item for a lone decode of few keys, one KV head for a few sequences
    (and, in bfloat16, for a lone decode of many keys), whole sequences (every head) for many,
    tiles of 16 queries zig-zagged over a long chunk, and (the float32 path) a KV head's query
    heads split where two threads' runs meet. A query's output must not notice."""
    torch.manual_seed(5)
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    lengths = [200, *torch.randint(30, 150, (19,)).tolist()]
    tables, next_block = [], 0
    for n in lengths:
        tables.append(list(range(next_block, next_block + -(-n // block))))
        next_block += len(tables[-1])
    k_cache, v_cache = (torch.randn(next_block, block, kv_heads, head_dim).to(dtype) for _ in "kv")
    q = torch.randn(200, heads, head_dim).to(dtype)  # row i: the query at position i of seq 0

    def attend(query_lens: list[int], seqs: list[int], end: int = 200) -> torch.Tensor:
        """Seq 0's queries up to position end - 1 (its last query_lens[0]), beside decodes."""
        group = QueryGroup.build(
            query_lens, [end, *[lengths[i] for i in seqs[1:]]], [tables[i] for i in seqs],
            [0, *[query_lens[0]] * (len(seqs) - 1)], block, invariant=True,
        )  # fmt: skip
        rows = torch.cat([q[end - query_lens[0] : end], q[199:200]])  # neighbours reuse one
        out = ext().cached_attention(rows, k_cache, v_cache, group.query_index,
                                     group.key_slots, group.query_lens, group.context_lens,
                                     0.125)  # fmt: skip
        return out[0, query_lens[0] - 1]  # seq 0's query at position end - 1

    few_keys = attend([1], [0], end=100)  # one query head per item
    assert torch.equal(few_keys, attend([1, 1, 1], [0, 1, 2], end=100))
    assert torch.equal(few_keys, attend([3], [0], end=100))
    alone = attend([1], [0])  # 200 keys: one KV head per item (bf16 on vdpbf16ps)
    assert torch.equal(alone, attend([1, 1, 1], [0, 1, 2]))  # one KV head per item
    assert torch.equal(alone, attend([2], [0]))  # two queries of 200 keys: one query head
    assert torch.equal(alone, attend([1] * 20, list(range(20))))  # whole sequences
    assert torch.equal(alone, attend([9, 1, 1], [0, 1, 2]))  # the last of a verification
    assert torch.equal(alone, attend([150], [0]))  # the last of a chunk of 10 tiles
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 4, 5):
            torch.set_num_threads(count)
            assert torch.equal(alone, attend([1], [0])), count
            assert torch.equal(alone, attend([9, 1, 1], [0, 1, 2])), count
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_long_sequence_spread_over_threads_gets_the_bits_of_any_other_cut(
    dtype: torch.dtype,
) -> None:
    """From 512 keys, a lone float32 sequence's decode or verification is spread over the threads
    by keys, then by value dims (cpu_ops.cpp's cached_attention_spread); beside other sequences,
    in a long chunk or on one thread it is cut by KV heads. Every cut gives a query the same
    bits, at, below and well above the 512 keys, and stays close to torch's attention."""
    torch.manual_seed(7)
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    lengths = [1300, 700, 90]
    blocks = [-(-n // block) for n in lengths]
    order = torch.randperm(sum(blocks) + 7).tolist()  # blocks out of order, some unused
    tables = [order[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(3)]
    k_cache, v_cache = (torch.randn(len(order), block, kv_heads, head_dim).to(dtype) for _ in "kv")
    q = torch.randn(1300, heads, head_dim).to(dtype)  # row i: the query at position i of seq 0

    def attend(query_len: int, end: int, beside: int = 0) -> torch.Tensor:
        """Seq 0's last query_len queries up to position end - 1, beside decodes of 1 .. beside."""
        lens = [query_len] + [1] * beside
        group = QueryGroup.build(
            lens, [end, *lengths[1 : 1 + beside]], tables[: 1 + beside], [0] * len(lens), block,
            invariant=True,
        )  # fmt: skip
        rows = torch.cat([q[end - query_len : end], q[:beside]])
        out = ext().cached_attention(rows, k_cache, v_cache, group.query_index,
                                     group.key_slots, group.query_lens, group.context_lens,
                                     0.125)  # fmt: skip
        return out[0, :query_len]

    threads = torch.get_num_threads()
    try:
        for end in (511, 512, 513, 777, 1300):
            torch.set_num_threads(2)
            alone = attend(1, end)[0]  # spread from 512 keys (float32)
            verification = attend(9, end)  # spread: 9 queries
            assert torch.equal(verification[-1], alone), end
            assert torch.equal(attend(1, end, beside=2)[0], alone), end  # cut by KV heads
            assert torch.equal(attend(9, end, beside=2), verification), end
            assert torch.equal(attend(40, end)[-1], alone), end  # a chunk: cut by KV heads
            for count in (1, 3, 4):
                torch.set_num_threads(count)
                assert torch.equal(attend(1, end)[0], alone), (end, count)
                assert torch.equal(attend(9, end), verification), (end, count)
    finally:
        torch.set_num_threads(threads)
    keys = k_cache[tables[0]].flatten(0, 1)[:1300].transpose(0, 1).float()  # [Hkv, n, D]
    values = v_cache[tables[0]].flatten(0, 1)[:1300].transpose(0, 1).float()
    reference = torch.nn.functional.scaled_dot_product_attention(
        q[-9:].float().transpose(0, 1), keys, values, scale=0.125, enable_gqa=True,
        attn_mask=torch.ones(9, 1300, dtype=torch.bool).tril(1300 - 9),
    ).transpose(0, 1)  # fmt: skip
    tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(verification.float(), reference, rtol=tol, atol=tol)
