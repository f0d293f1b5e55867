"""Exact rejection sampling of drafts: the fused Triton kernels and their launchers (their torch
references: :mod:`specdec.kernels.rejection_reference`).

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling") keeps the output distribution of the target model exactly. For each sequence with
drafts ``d_0 .. d_{k-1}``, draft distributions ``q_j`` and target distributions ``p_j``:

    accepted token: draft ``d_j`` is kept with probability ``min(1, p_j(d_j) / q_j(d_j))``, decided
        in order, as ``p_j(d_j) > 0 and u_j * q_j(d_j) <= p_j(d_j)`` with ``u_j ~ U[0, 1)``.
    recovered token: at the first rejected position ``j`` a token is drawn from
        ``norm(max(0, p_j - q_j))`` and the sequence ends there. If that residual is all zero (only
        possible through rounding) the token is drawn from ``p_j`` instead.
    bonus token: if all ``k`` drafts are accepted, one more token is drawn from ``p_k``.
    greedy row: drafts are accepted while they equal ``argmax p_j``; the emitted token at the first
        mismatch (or at the bonus position) is that argmax. Greedy rows use no randomness, and as
        only their argmax matters their rows may hold raw logits instead of probabilities.

A deterministic drafter passes no ``draft_probs``: ``q_j`` is then one-hot at ``d_j``, so the accept
probability is ``p_j(d_j)`` and the residual is ``p_j`` with ``d_j`` zeroed.

Tokens are drawn without normalising by an exponential race: ``argmax_v r_v / E_v`` with
``E_v ~ Exp(1)`` picks ``v`` with probability ``r_v / sum(r)``. One noise vector per sequence serves
its recovered or bonus token, since exactly one of the two is drawn. All randomness comes in as
float64 tensors, so the kernel and the reference, fed the same noise, emit the same tokens.

Both implementations take the same arguments and return ``(output_token_ids, num_accepted)``.

**Row-token mode** (:func:`verify_row_tokens_triton`, the engine's verification on CUDA): every
target row brings its own noise ``[T + B, V]`` float32, keyed by the request's seed and the row's
output position, and each row's *row token* is the token plain decoding would emit there: the
argmax of the raw logits for a greedy row, the race winner ``argmax_v p_v / E_v`` for a random
one. A draft is accepted while it equals its row token; the first row token that differs, or the
bonus row's, ends the sequence. For a deterministic drafter this is again exact (the row token
follows ``p``, independently of the draft; see ``specdec/verifier.py``), and it emits the very
tokens of plain decoding with the same noise, so a seeded request does not depend on the drafter
or the batch. The race divides in float32, correctly rounded, as :func:`specdec.sampling.sample`
does, so the kernel, its reference and the CPU verifier pick the same token from the same noise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from specdec.kernels.rejection_reference import check_inputs, check_row_token_inputs


@triton.jit
def _rejection_sample_kernel(
    output_token_ids_ptr,  # [B, max_k + 1] int64, filled with -1 by the launcher
    num_accepted_ptr,  # [B] int64
    draft_token_ids_ptr,  # [T] int64
    cu_num_draft_tokens_ptr,  # [B] int64
    draft_probs_ptr,  # [T, V] float; read only if HAS_DRAFT_PROBS
    target_probs_ptr,  # [T + B, V] float
    is_greedy_ptr,  # [B] bool
    accept_uniforms_ptr,  # [T] float64
    race_exponentials_ptr,  # [B, V] float64; with ROW_TOKENS [T + B, V] float32, one per row
    vocab_size,
    output_stride,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW_TOKENS: tl.constexpr = False,  # accept a draft iff it equals its row's token
):
    # One program walks one sequence. Each step either accepts a draft from two scalar loads
    # (random rows) or makes one pass over the vocabulary that yields the greedy argmax, the
    # recovered token or the bonus token; the walk ends at the first position not accepted.
    seq = tl.program_id(0).to(tl.int64)
    draft_start = tl.load(cu_num_draft_tokens_ptr + seq - 1, mask=seq > 0, other=0)
    num_drafts = tl.load(cu_num_draft_tokens_ptr + seq) - draft_start
    sampled = tl.load(is_greedy_ptr + seq) == 0  # a random (non-greedy) row
    j = num_drafts * 0  # position in the sequence == number of drafts accepted so far
    done = num_drafts < 0
    while done == 0:
        draft_row = draft_start + j  # row in draft_token_ids / draft_probs
        target_row = draft_row + seq  # row in target_probs: sequence i has i earlier bonus rows
        is_draft = j < num_drafts
        token = tl.load(draft_token_ids_ptr + draft_row, mask=is_draft, other=-1)
        if ROW_TOKENS:
            row_token = _row_token(
                target_probs_ptr + target_row * vocab_size,
                race_exponentials_ptr + target_row * vocab_size,
                sampled,
                vocab_size,
                BLOCK,
            )
            accept = is_draft & (row_token == token)
            token = tl.where(accept, token, row_token)
        else:
            token, accept = _ratio_test_step(
                draft_probs_ptr,
                target_probs_ptr,
                accept_uniforms_ptr,
                race_exponentials_ptr,
                seq,
                draft_row,
                target_row,
                token,
                is_draft,
                sampled,
                vocab_size,
                HAS_DRAFT_PROBS,
                BLOCK,
            )
        tl.store(output_token_ids_ptr + seq * output_stride + j, token)
        j += accept.to(tl.int64)
        done = accept == 0
    tl.store(num_accepted_ptr + seq, j)


@triton.jit
def _ratio_test_step(
    draft_probs_ptr,
    target_probs_ptr,
    accept_uniforms_ptr,
    race_exponentials_ptr,
    seq,
    draft_row,
    target_row,
    token,  # the draft at this position, -1 at the bonus position
    is_draft,
    sampled,
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One position of the min(1, p / q) walk: (the token emitted there, whether it was a draft
    accepted)."""
    test = is_draft & sampled  # a draft of a random row: the ratio test decides
    p_d = tl.load(target_probs_ptr + target_row * vocab_size + token, mask=test, other=0)
    p_d = p_d.to(tl.float32).to(tl.float64)
    q_d = 1.0  # one-hot q at the draft
    if HAS_DRAFT_PROBS:
        q_d = tl.load(draft_probs_ptr + draft_row * vocab_size + token, mask=test, other=0)
        q_d = q_d.to(tl.float32).to(tl.float64)
    u = tl.load(accept_uniforms_ptr + draft_row, mask=test, other=1.0)
    accept = test & (p_d > 0) & (u * q_d <= p_d)
    if accept == 0:
        raced = _race_row(
            target_probs_ptr + target_row * vocab_size,
            draft_probs_ptr + draft_row * vocab_size,
            race_exponentials_ptr + seq * vocab_size,
            token,
            test,  # subtract q: this is a rejected draft of a random row
            sampled,
            vocab_size,
            HAS_DRAFT_PROBS,
            BLOCK,
        )
        accept = is_draft & (sampled == 0) & (raced == token)  # a greedy draft that matches
        token = tl.where(accept, token, raced)
    return token, accept


@triton.jit
def _row_token(
    p_ptr,  # [V] target row: probabilities of a random row, raw logits of a greedy one
    noise_ptr,  # [V] float32 Exp(1) noise of this row, read if sampled
    sampled,  # a random row (race with the noise) or a greedy one (plain argmax)
    vocab_size,
    BLOCK: tl.constexpr,
):
    """The token plain decoding emits at this row: argmax_v p_v / E_v, or argmax_v p_v."""
    best = tl.zeros((), tl.float32) - float("inf")
    arg = tl.zeros((), tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)  # [BLOCK]
        in_vocab = offs < vocab_size
        p = tl.load(p_ptr + offs, mask=in_vocab, other=0).to(tl.float32)
        noise = tl.load(noise_ptr + offs, mask=tl.where(sampled, in_vocab, False), other=1.0)
        score = tl.where(sampled, tl.math.div_rn(p, noise.to(tl.float32)), p)
        score = tl.where(in_vocab, score, -float("inf"))
        block_best, block_arg = tl.max(score, 0, return_indices=True)  # first index of the max
        arg = tl.where(block_best > best, start + block_arg, arg)  # earlier blocks win ties
        best = tl.maximum(best, block_best)
    return arg.to(tl.int64)


@triton.jit
def _race_row(
    p_ptr,  # [V] target row
    q_ptr,  # [V] draft row, read if use_q and HAS_DRAFT_PROBS
    noise_ptr,  # [V] float64 Exp(1) noise, read if sampled
    token,  # the draft: q is one-hot here without draft probs
    use_q,  # subtract q (a rejected draft) or not (bonus position, greedy row)
    sampled,  # a random row (race with the noise) or a greedy one (plain argmax of p)
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Random rows: argmax_v r_v / E_v over r = max(0, p - q), or over p if r is all zero.

    Greedy rows: argmax_v p_v of the raw values, so their rows may hold logits.
    """
    best_r = tl.zeros((), tl.float64) - 1.0
    best_p = tl.zeros((), tl.float64) - float("inf")
    arg_r = tl.zeros((), tl.int32)
    arg_p = tl.zeros((), tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)  # [BLOCK]
        in_vocab = offs < vocab_size
        p = tl.load(p_ptr + offs, mask=in_vocab, other=0).to(tl.float32)
        # Masks mixing a block with a scalar flag go through tl.where: Triton's interpreter does
        # not keep `block & scalar` boolean.
        if HAS_DRAFT_PROBS:
            q = tl.load(q_ptr + offs, mask=tl.where(use_q, in_vocab, False), other=0)
            q = q.to(tl.float32)
        else:
            q = tl.where(tl.where(use_q, offs == token, False), 1.0, 0.0)
        r = tl.maximum(p - q, 0.0)
        noise = tl.load(noise_ptr + offs, mask=tl.where(sampled, in_vocab, False), other=1.0)
        score_r = tl.where(in_vocab, tl.where(r > 0, r.to(tl.float64) / noise, 0.0), -1.0)
        race_p = tl.where(p > 0, p.to(tl.float64) / noise, 0.0)
        score_p = tl.where(in_vocab, tl.where(sampled, race_p, p.to(tl.float64)), -float("inf"))
        block_r, block_arg_r = tl.max(score_r, 0, return_indices=True)  # first index of the max
        block_p, block_arg_p = tl.max(score_p, 0, return_indices=True)
        arg_r = tl.where(block_r > best_r, start + block_arg_r, arg_r)  # earlier blocks win ties
        arg_p = tl.where(block_p > best_p, start + block_arg_p, arg_p)
        best_r = tl.maximum(best_r, block_r)
        best_p = tl.maximum(best_p, block_p)
    return tl.where(sampled & (best_r > 0), arg_r, arg_p).to(tl.int64)


def rejection_sample_triton(
    draft_token_ids: torch.Tensor,  # [T] int64
    cu_num_draft_tokens: torch.Tensor,  # [B] int64, inclusive cumulative sum of k_i
    draft_probs: torch.Tensor | None,  # [T, V] float32/float16/bfloat16, or None (one-hot q)
    target_probs: torch.Tensor,  # [T + B, V] float32/float16/bfloat16
    is_greedy: torch.Tensor,  # [B] bool
    accept_uniforms: torch.Tensor,  # [T] float64 in [0, 1)
    race_exponentials: torch.Tensor,  # [B, V] float64, Exp(1)
    max_k: int,  # max_i k_i
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, max_k + 1] int64 (-1 padded), [B] int64
    """Launch the fused kernel, one program per sequence.

    CUDA tensors run the compiled kernel. CPU tensors need Triton's interpreter, selected by
    ``TRITON_INTERPRET=1`` before triton is first imported; it is exact but slow, meant for tests.
    """
    check_inputs(
        draft_token_ids,
        cu_num_draft_tokens,
        draft_probs,
        target_probs,
        is_greedy,
        accept_uniforms,
        race_exponentials,
    )
    batch, vocab = cu_num_draft_tokens.numel(), target_probs.shape[1]
    device = target_probs.device
    output_token_ids = torch.full((batch, max_k + 1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return output_token_ids, num_accepted
    kernel = _kernel_for(device)
    kernel[(batch,)](
        output_token_ids,
        num_accepted,
        draft_token_ids,
        cu_num_draft_tokens,
        target_probs if draft_probs is None else draft_probs,
        target_probs,
        is_greedy,
        accept_uniforms,
        race_exponentials,
        vocab,
        output_token_ids.stride(0),
        HAS_DRAFT_PROBS=draft_probs is not None,
        BLOCK=min(triton.next_power_of_2(vocab), 2048 if device.type == "cuda" else 8192),
        num_warps=8,
        enable_fp_fusion=False,  # no fused multiply-adds: match the reference bit for bit
    )
    return output_token_ids, num_accepted


def verify_row_tokens_triton(
    draft_token_ids: torch.Tensor,  # [T] int64
    cu_num_draft_tokens: torch.Tensor,  # [B] int64, inclusive cumulative sum of k_i
    target_rows: torch.Tensor,  # [T + B, V] float: probabilities (random rows), logits (greedy)
    is_greedy: torch.Tensor,  # [B] bool
    row_noise: torch.Tensor,  # [T + B, V] float32 Exp(1) noise of each row (unread if greedy)
    max_k: int,  # max_i k_i
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, max_k + 1] int64 (-1 padded), [B] int64
    """Row-token verification (see the module docstring) in one launch, a program per sequence."""
    check_row_token_inputs(draft_token_ids, cu_num_draft_tokens, target_rows, is_greedy, row_noise)
    batch, vocab = cu_num_draft_tokens.numel(), target_rows.shape[1]
    device = target_rows.device
    output_token_ids = torch.full((batch, max_k + 1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return output_token_ids, num_accepted
    _kernel_for(device)[(batch,)](
        output_token_ids,
        num_accepted,
        draft_token_ids,
        cu_num_draft_tokens,
        target_rows,  # draft probs: unread
        target_rows,
        is_greedy,
        row_noise,  # accept uniforms: unread
        row_noise,
        vocab,
        output_token_ids.stride(0),
        HAS_DRAFT_PROBS=False,
        BLOCK=min(triton.next_power_of_2(vocab), 2048 if device.type == "cuda" else 8192),
        ROW_TOKENS=True,
        num_warps=8,
        enable_fp_fusion=False,
    )
    return output_token_ids, num_accepted


def _kernel_for(device: torch.device) -> triton.JITFunction | InterpretedFunction:
    """The kernel, once checked to run: compiled for CUDA, or in the interpreter for CPU tensors."""
    interpreted = isinstance(_rejection_sample_kernel, InterpretedFunction)
    if interpreted != isinstance(tl.max, InterpretedFunction):
        raise RuntimeError(
            "TRITON_INTERPRET changed after triton was imported; set it before anything imports "
            "triton (torch._dynamo and transformers do), e.g. at the top of tests/conftest.py"
        )
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(
            "the Triton rejection kernel needs CUDA tensors, or TRITON_INTERPRET=1 set before "
            "triton is first imported to run on CPU; use backend='torch' otherwise"
        )
    return _rejection_sample_kernel
