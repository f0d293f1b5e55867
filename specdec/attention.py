"""Paged attention: write this step's K/V into the block cache, then attend over each context.

One function, :func:`paged_attention`, is the whole interface; the pure-torch path below is the
CPU implementation (correct first), and a Triton path for CUDA can sit behind the same call.

Per step the runner builds one :class:`AttentionMetadata` shared by every layer. Sequences are
split in two groups so that no work is wasted on padding:

* *fresh* sequences, whose whole context is computed this step (a prompt with no cached prefix),
  attend causally to their own new K/V and never read the cache;
* the others (decodes, draft verification, later prefill chunks, prefix-cache hits) are padded
  to one batch and attend to K/V gathered from the cache through their block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Where each query token writes its K/V and which keys it may attend to."""

    slot_mapping: torch.Tensor  # [N] int64 cache slot (block_id * block_size + offset) per token
    fresh_ranges: list[tuple[int, int]]  # (start, end) in the flat batch of each fresh sequence
    query_index: torch.Tensor  # [G, Q] flat token index of each query of the cached group
    query_valid: torch.Tensor  # [G, Q] bool: real query (not padding)
    key_slots: torch.Tensor  # [G, C] cache slot of each context key of the cached group
    mask: torch.Tensor | None  # [G, 1, Q, C] bool: query may see key; None: it sees them all
    dense: bool  # the cached group is the whole batch, in order, with no padding: [N] = [G, Q]
    valid_index: torch.Tensor  # [M] flat token index of each real query of the cached group
    valid_rows: torch.Tensor  # [M] its row in the flattened [G * Q] group

    @staticmethod
    def build(
        query_lens: list[int],  # [B] query tokens of each sequence this step
        context_lens: list[int],  # [B] tokens in context after this step (computed + query)
        block_tables: list[list[int]],  # [B][num_blocks] block ids of each sequence
        slot_mapping: torch.Tensor,  # [N]
        block_size: int,
    ) -> AttentionMetadata:
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        fresh = [i for i, (q, c) in enumerate(zip(query_lens, context_lens)) if q == c]
        cached = [i for i, (q, c) in enumerate(zip(query_lens, context_lens)) if q != c]
        fresh_ranges = [(starts[i], starts[i + 1]) for i in fresh]
        q_len = torch.tensor([query_lens[i] for i in cached], dtype=torch.long)  # [G]
        c_len = torch.tensor([context_lens[i] for i in cached], dtype=torch.long)  # [G]
        max_q = int(q_len.max()) if cached else 0
        max_c = int(c_len.max()) if cached else 0
        max_blocks = -(-max_c // block_size)
        tables = torch.tensor(
            [
                block_tables[i][:max_blocks]
                + [0] * (max_blocks - len(block_tables[i][:max_blocks]))
                for i in cached
            ],
            dtype=torch.long,
        ).view(len(cached), max_blocks)  # [G, max_blocks], padded with block 0
        first = torch.tensor([starts[i] for i in cached], dtype=torch.long)  # [G]
        j = torch.arange(max_q)  # [Q]
        query_valid = j < q_len[:, None]  # [G, Q]
        query_index = torch.where(query_valid, first[:, None] + j, 0)  # [G, Q]
        pos = torch.arange(max_c)  # [C]
        key_slots = tables[:, pos // block_size] * block_size + pos % block_size  # [G, C]
        # Query j sits at position c - q + j and sees keys at positions <= its own; padding
        # rows see key 0 only, so that their softmax stays finite.
        query_pos = torch.where(query_valid, (c_len - q_len)[:, None] + j, 0)  # [G, Q]
        mask = (pos <= query_pos[:, :, None]) & (pos < c_len[:, None, None])  # [G, Q, C]
        dense = not fresh and bool(query_valid.all())
        # One query per sequence and equal contexts: every key is visible, no mask needed.
        every_key = max_q == 1 and bool((c_len == max_c).all())
        attn_mask = None if every_key else mask.unsqueeze(1)
        valid_rows = query_valid.flatten().nonzero().squeeze(1)  # [M]
        return AttentionMetadata(
            slot_mapping,
            fresh_ranges,
            query_index,
            query_valid,
            key_slots,
            attn_mask,
            dense,
            query_index.flatten()[valid_rows],
            valid_rows,
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
    k_flat[meta.slot_mapping] = k
    v_flat[meta.slot_mapping] = v
    if meta.dense:  # decodes and verification only: no gather of queries, no scatter of outputs
        groups, width = meta.query_index.shape
        q_dense = q.view(groups, width, *q.shape[1:])  # [G, Q, Hq, D]
        o_dense = _attend(q_dense, _gather(k_flat, meta), _gather(v_flat, meta), meta.mask, scale)
        return o_dense.reshape(q.shape)
    out = torch.empty_like(q)
    for start, end in meta.fresh_ranges:
        out[start:end] = _attend(
            q[start:end].unsqueeze(0),
            k[start:end].unsqueeze(0),
            v[start:end].unsqueeze(0),
            None,
            scale,
        )[0]
    if meta.query_index.numel():
        qg = q[meta.query_index]  # [G, Q, Hq, D]
        og = _attend(qg, _gather(k_flat, meta), _gather(v_flat, meta), meta.mask, scale)
        out[meta.valid_index] = og.flatten(0, 1)[meta.valid_rows]
    return out


def _gather(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The cached group's keys (or values): ``[G, C, Hkv, D]`` from ``[num_slots, Hkv, D]``.

    ``index_select`` on the flat slot list: 2-3x faster on the CPU than advanced indexing with
    the ``[G, C]`` slot tensor, and with 32 sequences this gather is a large part of a step.
    """
    groups, width = meta.key_slots.shape
    return cache.index_select(0, meta.key_slots.view(-1)).view(groups, width, *cache.shape[1:])


def _attend(
    q: torch.Tensor,  # [G, Q, Hq, D]
    k: torch.Tensor,  # [G, C, Hkv, D]
    v: torch.Tensor,  # [G, C, Hkv, D]
    mask: torch.Tensor | None,  # [G, 1, Q, C] bool, or None: causal if Q == C, else no mask
    scale: float,
) -> torch.Tensor:  # [G, Q, Hq, D]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None and q.shape[1] > 1,  # only fresh prompts (Q == C) pass no mask
        scale=scale,
        enable_gqa=True,
    )  # [G, Hq, Q, D]
    return out.transpose(1, 2)
