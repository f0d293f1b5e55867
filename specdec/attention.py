"""Paged attention: write this step's K/V into the block cache, then attend over each context.

One function, :func:`paged_attention`, is the whole interface. On the CPU, decodes and
verifications run as one C++ call and the rest through torch's SDPA; on CUDA (metadata built with
``triton=True``), decodes and verifications run the Triton paged-attention kernel
(``kernels/paged_attention.py``), which reads keys through the block tables, and prompts torch's
fused SDPA (flash or memory-efficient), on their own K/V or, after a prefix-cache hit or in a
later chunk, on K/V gathered from the cache.

Per step the runner builds one :class:`AttentionMetadata` shared by every layer. Sequences are
split into groups so that little work is wasted on padding:

* *fresh* sequences, whose whole context is computed this step (a prompt with no cached prefix),
  attend causally to their own new K/V and never read the cache;
* the others attend to K/V read from the cache through their block tables: sequences of at
  most :data:`NARROW_QUERY` queries (decodes and verifications) padded into one group, which
  on the CPU runs as one fused C++ call that reads keys by slot (``kernels/cpu_ops.cpp``); and
  each wider query (a later prefill chunk, a prompt after a prefix-cache hit) as a group of its
  own, through torch's SDPA on gathered K/V, so that no decode is padded to a chunk's width.

**Batch-invariant mode** (``invariant=True``, the default where the CPU kernels are vector code):
a query row's output is bitwise the same whatever else the step holds: how many drafts its
sequence verifies, which other sequences share the step, how a prompt was cut into prefill
chunks. Speculative decoding needs this to give exactly the tokens of plain decoding: in bfloat16
a one-ulp difference in a hidden state flips near-tied argmaxes within a few dozen tokens. The idea is that of Thinking Machines'
"Defeating Nondeterminism in LLM Inference" (He et al., 2025): every reduction runs in an order
that does not depend on the batch. Here that holds because

* attention runs in the C++ kernel for every group, which computes each score, softmax and
  output row on its own in a fixed order, however it cuts the call into work items (per query
  head, per KV head, whole sequences); without the kernels, two bf16 matmuls whose shapes keep
  oneDNN's per-element reduction order fixed for any number of queries (see
  :func:`_attend_invariant`), with masked keys adding exact zeros;
* the model's linears run on packed weights, each output one chain over its inputs whatever the
  row count: float32 in lanes of 16 features, bf16 in input pairs on AMX tiles or ``vdpbf16ps``
  (:class:`specdec.models.linear.RowLinear`; without the kernels, oneDNN calls of at most 32
  rows, which holds on AMX CPUs), and the other ops of a layer work row by row
  (:mod:`specdec.kernels.cpu_ops`);
* there is no fresh path: every sequence reads its keys back from the cache, and a prompt chunk
  wider than :data:`NARROW_QUERY` queries is a group of its own (no padding to its width).

``tests/test_batch_invariance.py`` checks the property against one-token decodes on the kernels
of the machine it runs on. What it costs is prefill speed where the CPU has no AMX (linears at
the ``vdpbf16ps`` rate instead of oneDNN's), and attention without torch's flash kernel;
``batch_invariant=False`` trades the exactness back for that.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.kernels import cpu_ops
from specdec.kernels.paged_attention import paged_attention_triton

NARROW_QUERY = 17  # queries of a decode or a verification of up to 16 drafts: padded together
# Invariant mode pads key counts to a multiple of this: few GEMM shapes, and every float32 pass
# over a score row runs whole vector blocks (no scalar tail, whose rounding could differ).
KEY_ALIGN = 64
QUERY_TILE = 128  # invariant mode: query positions per score matrix (bounds its memory)


@dataclass(slots=True)
class QueryGroup:
    """Sequences attended together: queries padded to ``[G, Q]``, keys gathered to ``[G, C]``."""

    query_index: torch.Tensor  # [G, Q] flat token index of each query (0 for padding)
    key_slots: torch.Tensor  # [G, C] cache slot of each context key (slot 0 for padding)
    mask: torch.Tensor | None  # [G, 1, Q, C] bool: query may see key; None: it sees them all
    valid_index: torch.Tensor  # [M] flat token index of each real query
    valid_rows: torch.Tensor  # [M] its row in the flattened [G * Q] group
    query_lens: torch.Tensor  # [G] queries of each sequence
    context_lens: torch.Tensor  # [G] keys of each sequence (its last query sees them all)
    max_start: int = 0  # largest position of a first query: query j sees < max_start + j + 1
    # What the Triton kernel reads, built only for it (triton=True):
    block_tables: torch.Tensor | None = None  # [G, max_blocks] int32 (padded with block 0)
    cu_query_lens: torch.Tensor | None = None  # [G + 1] int32 prefix sums of query_lens from 0
    seq_lens: torch.Tensor | None = None  # [G] int32 context_lens
    # Built on first use by the oneDNN invariant path, then shared by every layer of the step:
    head_rows: torch.Tensor | None = None  # [G * Hkv * C] cache row per key
    bias: torch.Tensor | None = None  # the mask as float32 0 / -inf, [G, 1, Q, C]

    @staticmethod
    def build(
        query_lens: list[int],  # [G]
        context_lens: list[int],  # [G]
        block_tables: list[list[int]],  # [G][num_blocks]
        starts: list[int],  # [G] flat index of each sequence's first query
        block_size: int,
        invariant: bool,
        triton: bool = False,
    ) -> QueryGroup:
        # The index arithmetic runs in numpy: on arrays this small one torch call costs about
        # what numpy takes for all of it, and this runs before every forward, drafts' included.
        q_len = np.asarray(query_lens, dtype=np.int64)  # [G]
        c_len = np.asarray(context_lens, dtype=np.int64)  # [G]
        max_q, max_c = max(query_lens), max(context_lens)
        if invariant:
            max_c = -(-max_c // KEY_ALIGN) * KEY_ALIGN
        max_blocks = -(-max_c // block_size)
        tables = np.zeros((len(block_tables), max_blocks), dtype=np.int64)  # padded with block 0
        for row, table in zip(tables, block_tables):
            row[: min(len(table), max_blocks)] = table[:max_blocks]
        j = np.arange(max_q)  # [Q]
        query_valid = j < q_len[:, None]  # [G, Q]
        first = np.asarray(starts, dtype=np.int64)  # [G]
        query_index = np.where(query_valid, first[:, None] + j, 0)  # [G, Q]
        pos = np.arange(max_c)  # [C]
        key_slots = tables[:, pos // block_size] * block_size + pos % block_size  # [G, C]
        # Query j sits at position c - q + j and sees keys at positions <= its own; padding
        # rows see key 0 only, so that their softmax stays finite.
        query_pos = np.where(query_valid, (c_len - q_len)[:, None] + j, 0)  # [G, Q]
        mask: torch.Tensor | None = None  # one query per sequence and equal contexts: sees all
        if invariant or max_q > 1 or not (c_len == max_c).all():
            visible = (pos <= query_pos[:, :, None]) & (pos < c_len[:, None, None])  # [G, Q, C]
            mask = _tensor(visible[:, None])  # [G, 1, Q, C]
        valid_rows = np.flatnonzero(query_valid)  # [M]
        group = QueryGroup(
            _tensor(query_index),
            _tensor(key_slots),
            mask,
            _tensor(query_index.reshape(-1)[valid_rows]),
            _tensor(valid_rows),
            _tensor(q_len),
            _tensor(c_len),
            int((c_len - q_len).max()),
        )
        if triton:
            group.block_tables, group.seq_lens = _tensor(tables).int(), _tensor(c_len).int()
            group.cu_query_lens = _tensor(np.cumsum([0, *query_lens], dtype=np.int32))
        return group


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A contiguous tensor of ``array`` (numpy's fancy indexing may leave another layout)."""
    return torch.from_numpy(np.ascontiguousarray(array))


@dataclass(slots=True)
class PagedBatch:
    """A whole step of decodes and verifications for the Triton kernel, already on the device:
    what a captured CUDA graph reads (see :mod:`specdec.cuda_graphs`). Sequences past the step's
    real ones have no queries and no context; query rows past ``cu_query_lens[-1]`` belong to
    no sequence (their output is undefined, and no real row reads it)."""

    cu_query_lens: torch.Tensor  # [G + 1] int32 prefix sums of the queries from 0
    seq_lens: torch.Tensor  # [G] int32 context length of each sequence (0 for padding)
    block_tables: torch.Tensor  # [G, max_blocks] int32
    max_query_len: int  # the kernel's tile-size hint; results do not depend on it


@dataclass(slots=True)
class AttentionMetadata:
    """Where each query token writes its K/V and which keys it may attend to."""

    slot_mapping: torch.Tensor  # [N] int64 cache slot (block_id * block_size + offset) per token
    fresh_ranges: list[tuple[int, int]]  # (start, end) in the flat batch of each fresh sequence
    groups: list[QueryGroup]  # the sequences that read keys from the cache
    dense: bool  # one group, the whole batch in order with no padding: [N] = [G, Q]
    invariant: bool  # batch-invariant attention (see the module docstring)
    # Set instead of groups: every query row reads the cache through the Triton kernel in one
    # call (a graphed step; the rows are the step's tokens in order, then padding)
    paged: PagedBatch | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the step's metadata, in a fixed order (see :meth:`replace_tensors`)."""
        found = [self.slot_mapping]
        for group in self.groups:
            found += [v for f in fields(group) if isinstance(v := getattr(group, f.name), Tensor)]
        return found

    def replace_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Put ``tensors`` (copies of :meth:`tensors`' on another device) in their places."""
        it = iter(tensors)
        self.slot_mapping = next(it)
        for group in self.groups:
            for f in fields(group):
                if isinstance(getattr(group, f.name), Tensor):
                    setattr(group, f.name, next(it))

    @staticmethod
    def build(
        query_lens: list[int],  # [B] query tokens of each sequence this step
        context_lens: list[int],  # [B] tokens in context after this step (computed + query)
        block_tables: list[list[int]],  # [B][num_blocks] block ids of each sequence
        slot_mapping: torch.Tensor,  # [N]
        block_size: int,
        invariant: bool = False,
        triton: bool = False,
    ) -> AttentionMetadata:
        """``triton``: decodes and verifications through the Triton kernel (not in invariant
        mode, a CPU mode)."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        seqs = range(len(query_lens))
        fresh = [] if invariant else [i for i in seqs if query_lens[i] == context_lens[i]]
        cached = [i for i in seqs if invariant or query_lens[i] != context_lens[i]]
        # Decodes and verifications share one group; a wide query (a prompt chunk) is a group
        # of its own, so that nothing is padded to its width.
        narrow = [i for i in cached if query_lens[i] <= NARROW_QUERY]
        parts = [narrow] if narrow else []
        parts += [[i] for i in cached if query_lens[i] > NARROW_QUERY]
        groups = [
            QueryGroup.build(
                [query_lens[i] for i in part],
                [context_lens[i] for i in part],
                [block_tables[i] for i in part],
                [starts[i] for i in part],
                block_size,
                invariant,
                triton and not invariant and part is narrow,
            )
            for part in parts
        ]
        dense = (
            len(groups) == 1
            and len(parts[0]) == len(query_lens)
            and groups[0].valid_rows.numel() == groups[0].query_index.numel()
        )
        return AttentionMetadata(
            slot_mapping,
            [(starts[i], starts[i + 1]) for i in fresh],
            groups,
            dense,
            invariant,
        )


def paged_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D] this step's keys
    v: torch.Tensor,  # [N, Hkv, D] this step's values
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [N, Hq, D]
    """Store K/V at their slots, then attend each query to its sequence's keys (causal, GQA)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    kernels = cpu_ops.extension_for(q)
    if kernels is not None:
        kernels.write_kv_(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        k_flat[meta.slot_mapping] = k
        v_flat[meta.slot_mapping] = v
    if meta.paged is not None:
        paged = meta.paged
        return paged_attention_triton(
            q.contiguous(), paged.cu_query_lens, paged.seq_lens, paged.block_tables,
            k_cache, v_cache, scale, paged.max_query_len,
        )  # fmt: skip

    def attend(group: QueryGroup) -> torch.Tensor:  # [G, Q, Hq, D]
        if kernels is not None and (meta.invariant or group.query_index.shape[1] <= NARROW_QUERY):
            # one call reads the keys by slot, no gathered copies; rows are batch-invariant
            return kernels.cached_attention(
                q, k_cache, v_cache, group.query_index, group.key_slots,
                group.query_lens, group.context_lens, scale,
            )  # fmt: skip
        shape = (*group.query_index.shape, *q.shape[1:])
        queries = q.view(shape) if meta.dense else q[group.query_index]
        if meta.invariant:
            keys, values = _gather_heads(k_flat, group), _gather_heads(v_flat, group)
            return _attend_invariant(queries, keys, values, group, scale)
        return _attend(queries, _gather(k_flat, group), _gather(v_flat, group), group, scale)

    def attend_triton(group: QueryGroup) -> torch.Tensor:  # [M, Hq, D] the group's real rows
        queries = q.contiguous() if meta.dense else q[group.valid_index]
        cu_q_lens, seq_lens, tables = group.cu_query_lens, group.seq_lens, group.block_tables
        assert cu_q_lens is not None and seq_lens is not None and tables is not None
        max_q_len = group.query_index.shape[1]  # known here: the kernel need not read it back
        return paged_attention_triton(
            queries, cu_q_lens, seq_lens, tables, k_cache, v_cache, scale, max_q_len
        )

    def use_triton(group: QueryGroup) -> bool:  # built for the kernel: see AttentionMetadata.build
        return group.block_tables is not None

    if meta.dense:  # decodes and verification only: no scatter of outputs
        if use_triton(meta.groups[0]):
            return attend_triton(meta.groups[0])
        return attend(meta.groups[0]).reshape(q.shape)
    out = torch.empty_like(q)
    for start, end in meta.fresh_ranges:
        out[start:end] = _attend_causal(q[start:end], k[start:end], v[start:end], scale)
    for group in meta.groups:
        if use_triton(group):
            out.index_copy_(0, group.valid_index, attend_triton(group))
            continue
        rows = attend(group).flatten(0, 1)  # [G * Q, Hq, D]
        if group.valid_rows.numel() != rows.shape[0]:  # drop the padding rows
            rows = rows[group.valid_rows]
        out.index_copy_(0, group.valid_index, rows)
    return out


def _gather_heads(cache: torch.Tensor, group: QueryGroup) -> torch.Tensor:
    """The group's keys (or values) head-major, ``[G * Hkv, C, D]``, in one gather.

    The cache is read as rows of one head each, ``[num_slots * Hkv, D]``, so the matmuls get
    contiguous per-head matrices without a transposing copy.
    """
    num_kv_heads, head_dim = cache.shape[1], cache.shape[2]
    if group.head_rows is None:  # once per step: every layer shares the group
        heads = torch.arange(num_kv_heads)
        group.head_rows = (group.key_slots[:, None, :] * num_kv_heads + heads[:, None]).view(-1)
    rows = cache.view(-1, head_dim).index_select(0, group.head_rows)
    return rows.view(-1, group.key_slots.shape[1], head_dim)


def _gather(cache: torch.Tensor, group: QueryGroup) -> torch.Tensor:
    """The group's keys (or values): ``[G, C, Hkv, D]`` from ``[num_slots, Hkv, D]``.

    ``index_select`` on the flat slot list: 2-3x faster on the CPU than advanced indexing with
    the ``[G, C]`` slot tensor, and with 32 sequences this gather is a large part of a step.
    """
    groups, width = group.key_slots.shape
    return cache.index_select(0, group.key_slots.view(-1)).view(groups, width, *cache.shape[1:])


def _attend(
    q: torch.Tensor,  # [G, Q, Hq, D]
    k: torch.Tensor,  # [G, C, Hkv, D]
    v: torch.Tensor,  # [G, C, Hkv, D]
    group: QueryGroup,
    scale: float,
) -> torch.Tensor:  # [G, Q, Hq, D]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=True,
    )  # [G, Hq, Q, D]
    return out.transpose(1, 2)


def _attend_causal(
    q: torch.Tensor,  # [L, Hq, D] a fresh prompt's queries
    k: torch.Tensor,  # [L, Hkv, D] and its keys and values
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [L, Hq, D]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )  # [1, Hq, L, D]
    return out[0].transpose(0, 1)


def _attend_invariant(
    q: torch.Tensor,  # [G, Q, Hq, D]
    keys: torch.Tensor,  # [G * Hkv, C, D]
    values: torch.Tensor,  # [G * Hkv, C, D]
    group: QueryGroup,
    scale: float,
) -> torch.Tensor:  # [G, Q, Hq, D]
    """Attention whose every output row has bits independent of the batch around it.

    Two bf16 matmuls per KV head, each with a shape whose per-element reduction order oneDNN
    keeps for any number of queries: scores ``q @ K^T`` sum over the head dimension only, and
    the output is computed transposed, ``V^T @ P^T``, so that its row count is the head
    dimension whatever the number of queries, and the keys are its reduction (masked keys add
    exact zeros). Scores are scaled, masked and normalised in float32. The ``g = Hq / Hkv``
    query heads that share a KV head are rows of the same matmul.
    """
    assert group.mask is not None
    if group.bias is None:
        group.bias = torch.zeros(group.mask.shape).masked_fill_(~group.mask, float("-inf"))
    batch, width, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[0] // batch
    share, context = num_heads // num_kv_heads, keys.shape[1]
    heads = q.view(batch, width, num_kv_heads, share, head_dim).transpose(1, 2)  # [G,Hkv,Q,g,D]
    out = q.new_empty(batch, width, num_kv_heads, share, head_dim)
    for s in range(0, width, QUERY_TILE):  # tiles bound the float32 scores' memory...
        t = min(QUERY_TILE, width - s)
        # ...and skip the keys no query of the tile sees (a prompt chunk's later keys).
        n = min(context, -(-(group.max_start + s + t) // KEY_ALIGN) * KEY_ALIGN)
        rows = heads[:, :, s : s + t].reshape(batch * num_kv_heads, t * share, head_dim)
        raw = torch.bmm(rows, keys[:, :n].transpose(1, 2))  # [G * Hkv, t * g, n]
        # bias + scale * scores in one float32 pass; [G, 1, t, 1, n] broadcast
        bias = group.bias[:, :, s : s + t, None, :n]
        scores = torch.add(bias, raw.view(batch, num_kv_heads, t, share, n), alpha=scale)
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(batch * num_kv_heads, t * share, n)
        mixed = torch.bmm(values[:, :n].transpose(1, 2), probs.transpose(1, 2))  # [G*Hkv, D, t*g]
        mixed = mixed.view(batch, num_kv_heads, head_dim, t, share).permute(0, 3, 1, 4, 2)
        out[:, s : s + t] = mixed  # [G, t, Hkv, g, D]
    return out.view(batch, width, num_heads, head_dim)
