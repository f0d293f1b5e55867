"""Paged attention for decodes and verifications: the Triton kernel, its launcher and its reference.

A batch holds ``B`` sequences. Sequence ``b`` brings ``q_len[b]`` query rows, the last positions of
a context of ``seq_lens[b]`` tokens (1 row for a decode, ``k + 1`` for a verification of ``k``
drafts, the whole context for a short prompt):

    position: query row ``i`` of sequence ``b`` sits at position ``seq_lens[b] - q_len[b] + i`` and
        attends causally to the keys at positions ``0 .. position``. The queries' own K/V are
        already in the cache, so every key and value is read from it.
    block table: the cache holds ``num_blocks`` blocks of ``block_size`` slots; the key at position
        ``p`` of sequence ``b`` is in block ``block_tables[b, p // block_size]``, slot
        ``p % block_size`` (vLLM's PagedAttention, Kwon et al. 2023, "Efficient Memory Management
        for Large Language Model Serving with PagedAttention"). Blocks need not be in any order.
    GQA group: ``Hq // Hkv`` query heads share one KV head; query head ``h`` reads KV head
        ``h // (Hq // Hkv)``.
    online softmax: the kernel walks the keys in tiles, keeping per query row the running maximum
        score ``m``, the running sum of ``exp(score - m)`` and the unnormalised output, rescaled
        whenever ``m`` grows (FlashAttention, Dao et al. 2022, "FlashAttention: Fast and
        Memory-Efficient Exact Attention with IO-Awareness"). Scores and sums are float32.

Inputs are flat: queries of all sequences back to back, ``[T, Hq, D]`` with ``T = sum(q_len)``,
delimited by ``cu_q_lens`` (``[B + 1]``, exclusive prefix sums from 0). The output has the
queries' shape and dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from specdec.kernels.launch_checks import check_tensors

ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634  # scores are kept in base 2, for exp2
MAX_BLOCK_M = 64  # query rows per tile: bounds the float32 accumulator's registers
BLOCK_N = 32  # keys per tile


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D] query dtype
    query_ptr,  # [T, Hq, D] float32/bfloat16/float16
    cu_q_lens_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks] int32
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D] query dtype
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D] query dtype
    qk_scale,  # softmax scale * log2(e)
    max_blocks,
    block_size,
    num_kv_heads,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,  # feed tl.dot float32 (the interpreter cannot multiply bfloat16)
):
    # One program per (sequence, KV head). Its GROUP query heads and q_len query rows form the
    # rows of one tile, so each K/V tile is read from the cache once per KV head and feeds a dot
    # of up to BLOCK_M rows: a verification of k drafts reads no more KV memory than a decode,
    # where a program per query row would read the context k + 1 times. Rows beyond BLOCK_M
    # (long verifications with large groups) are further passes over the same keys.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_start = tl.load(cu_q_lens_ptr + seq)
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * max_blocks
    for row_start in range(0, q_len * GROUP, BLOCK_M):
        _attend_rows(
            out_ptr, query_ptr, block_table_ptr, k_cache_ptr, v_cache_ptr,
            row_start, q_start, q_len, seq_len, kv_head, num_kv_heads, block_size, qk_scale,
            GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, UPCAST,
        )  # fmt: skip


@triton.jit
def _attend_rows(
    out_ptr,  # [T, Hq, D]
    query_ptr,  # [T, Hq, D]
    block_table_ptr,  # [max_blocks] this sequence's block table
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    row_start,  # first tile row; row r is query row r // GROUP, query head r % GROUP of the group
    q_start,
    q_len,
    seq_len,
    kv_head,
    num_kv_heads,
    block_size,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Attend BLOCK_M rows of one sequence and KV head to all their keys, one key tile at a time."""
    rows = row_start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    query_row = rows // GROUP  # [BLOCK_M] i
    row_valid = query_row < q_len  # [BLOCK_M] false for the tile's padding rows
    position = seq_len - q_len + query_row  # [BLOCK_M] the last key each row sees
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    dims = tl.arange(0, HEAD_DIM)  # [D]
    row_offsets = ((q_start + query_row).to(tl.int64) * num_kv_heads * GROUP + head) * HEAD_DIM
    q = tl.load(query_ptr + row_offsets[:, None] + dims[None, :], mask=row_valid[:, None], other=0)
    q = _dot_operand(q, UPCAST)  # [BLOCK_M, D]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max score (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running unnormalised output
    for key_start in range(0, seq_len, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        in_context = keys < seq_len  # [BLOCK_N]
        block = tl.load(block_table_ptr + keys // block_size, mask=in_context, other=0)
        slot = block.to(tl.int64) * block_size + keys % block_size  # [BLOCK_N] flat cache slot
        kv_offsets = (slot * num_kv_heads + kv_head) * HEAD_DIM  # [BLOCK_N]
        kv_ptrs = kv_offsets[:, None] + dims[None, :]  # [BLOCK_N, D]
        k = _dot_operand(tl.load(k_cache_ptr + kv_ptrs, mask=in_context[:, None], other=0), UPCAST)
        v = _dot_operand(tl.load(v_cache_ptr + kv_ptrs, mask=in_context[:, None], other=0), UPCAST)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (keys[None, :] <= position[:, None]) & row_valid[:, None]  # causal limit
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # [BLOCK_M]
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite for rows with no key yet
        p = tl.exp2(scores - m_ref[:, None])  # [BLOCK_M, BLOCK_N], 0 where not visible
        alpha = tl.exp2(m_i - m_ref)  # [BLOCK_M] rescales what earlier tiles summed
        l_i = l_i * alpha + tl.sum(p, 1)
        p = _dot_operand(p.to(v_cache_ptr.dtype.element_ty), UPCAST)  # V's dtype, for the MMA
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")  # [BLOCK_M, D]
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [BLOCK_M, D]; padding rows stay 0
    out_ptrs = out_ptr + row_offsets[:, None] + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _dot_operand(
    x,  # [M, N] a tl.dot operand
    UPCAST: tl.constexpr,
):
    """``x`` as given, or in float32 for Triton's interpreter (triton-lang/triton#11584)."""
    if UPCAST:
        x = x.to(tl.float32)
    return x


def paged_attention_triton(
    query: torch.Tensor,  # [T, Hq, D] float32/bfloat16/float16
    cu_q_lens: torch.Tensor,  # [B + 1] int32, exclusive prefix sums of q_len from 0
    seq_lens: torch.Tensor,  # [B] int32, context length including the queries
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padded with any valid block id
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] query dtype
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] query dtype
    scale: float | None = None,  # softmax scale, head_dim ** -0.5 if None
    max_q_len: int | None = None,  # max q_len, a tile-size hint; None reads it (a device sync)
) -> torch.Tensor:  # [T, Hq, D] query dtype
    """Launch the kernel on a ``(B, Hkv)`` grid. Results do not depend on ``max_q_len``.

    CUDA tensors run the compiled kernel. CPU tensors need Triton's interpreter, selected by
    ``TRITON_INTERPRET=1`` before triton is first imported; it is slow, meant for tests. Only
    shapes, dtypes and layouts are checked (no device sync): lengths that do not fit the block
    tables read out of bounds.
    """
    check_inputs(query, cu_q_lens, seq_lens, block_tables, k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 for the kernel, got {head_dim}")
    out = torch.empty_like(query)
    batch = seq_lens.numel()
    if batch == 0 or num_tokens == 0:
        return out
    if max_q_len is None:
        max_q_len = int(torch.diff(cu_q_lens).max())
    group = num_q_heads // num_kv_heads
    block_m = min(max(triton.next_power_of_2(max_q_len * group), 16), MAX_BLOCK_M)
    kernel, interpreted = _kernel_for(query.device)
    kernel[(batch, num_kv_heads)](
        out, query, cu_q_lens, seq_lens, block_tables, k_cache, v_cache,
        (head_dim**-0.5 if scale is None else scale) * LOG2E,
        block_tables.shape[1], block_size, num_kv_heads,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=BLOCK_N, UPCAST=interpreted,
    )  # fmt: skip
    return out


def _kernel_for(device: torch.device) -> tuple[triton.JITFunction | InterpretedFunction, bool]:
    """The kernel and whether it runs in the interpreter, once checked to run on ``device``."""
    interpreted = isinstance(_paged_attention_kernel, InterpretedFunction)
    if interpreted != isinstance(tl.max, InterpretedFunction):
        raise RuntimeError(
            "TRITON_INTERPRET changed after triton was imported; set it before anything imports "
            "triton (torch._dynamo and transformers do), e.g. at the top of tests/conftest.py"
        )
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(
            "the Triton paged-attention kernel needs CUDA tensors, or TRITON_INTERPRET=1 set "
            "before triton is first imported to run on CPU; use the reference otherwise"
        )
    return _paged_attention_kernel, interpreted


def check_inputs(
    query: torch.Tensor,  # [T, Hq, D]
    cu_q_lens: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
) -> None:
    """Raise ValueError on a wrong dtype, shape, device or memory layout (no device sync)."""
    ranks = [("query", query, 3), ("seq_lens", seq_lens, 1), ("k_cache", k_cache, 4)]
    for name, tensor, rank in [*ranks, ("block_tables", block_tables, 2)]:
        if tensor.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D, got shape {tuple(tensor.shape)}")
    num_q_heads, head_dim = query.shape[1:]
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    batch = seq_lens.shape[0]  # B is the number of context lengths
    expected = {
        "query": (query, tuple(query.shape), ATTENTION_DTYPES),
        "seq_lens": (seq_lens, (batch,), (torch.int32,)),
        "cu_q_lens": (cu_q_lens, (batch + 1,), (torch.int32,)),
        "block_tables": (block_tables, (batch, block_tables.shape[1]), (torch.int32,)),
        "k_cache": (k_cache, (num_blocks, block_size, num_kv_heads, head_dim), (query.dtype,)),
        "v_cache": (v_cache, (num_blocks, block_size, num_kv_heads, head_dim), (query.dtype,)),
    }
    check_tensors(expected, "query")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"Hq ({num_q_heads}) must be a multiple of Hkv ({num_kv_heads})")


def paged_attention_reference(
    query: torch.Tensor,  # [T, Hq, D]
    cu_q_lens: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    scale: float | None = None,
) -> torch.Tensor:  # [T, Hq, D] query dtype
    """The specification the kernel is tested against: one sequence at a time, float32 math."""
    check_inputs(query, cu_q_lens, seq_lens, block_tables, k_cache, v_cache)
    scale = query.shape[2] ** -0.5 if scale is None else scale
    out = torch.empty_like(query)
    bounds, lengths = cu_q_lens.tolist(), seq_lens.tolist()
    if bounds[-1] != query.shape[0]:
        raise ValueError(f"cu_q_lens ends at {bounds[-1]}, query has {query.shape[0]} rows")
    for b, seq_len in enumerate(lengths):
        start, end = bounds[b], bounds[b + 1]
        if not 0 <= end - start <= seq_len <= block_tables.shape[1] * k_cache.shape[1]:
            raise ValueError(f"sequence {b}: q_len {end - start} and seq_len {seq_len} do not fit")
        keys = _gather_context(k_cache, block_tables[b], seq_len)  # [L, Hkv, D]
        values = _gather_context(v_cache, block_tables[b], seq_len)  # [L, Hkv, D]
        out[start:end] = _attend(query[start:end], keys, values, scale)
    return out


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks]
    seq_len: int,
) -> torch.Tensor:  # [L, Hkv, D] the keys (or values) at positions 0 .. L - 1
    positions = torch.arange(seq_len, device=cache.device)  # [L]
    blocks = block_table.long()[positions // cache.shape[1]]  # [L]
    return cache[blocks, positions % cache.shape[1]]


def _attend(
    query: torch.Tensor,  # [Q, Hq, D] the last Q positions of the context
    keys: torch.Tensor,  # [L, Hkv, D]
    values: torch.Tensor,  # [L, Hkv, D]
    scale: float,
) -> torch.Tensor:  # [Q, Hq, D] query dtype
    q_len, seq_len = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)  # [L, Hq, D]: head h reads h // group
    values = values.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale  # [Hq, Q, L]
    positions = torch.arange(seq_len - q_len, seq_len, device=query.device)  # [Q]
    visible = torch.arange(seq_len, device=query.device) <= positions[:, None]  # [Q, L]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)  # [Hq, Q, L]
    return torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
