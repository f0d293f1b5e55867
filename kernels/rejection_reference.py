"""The torch specification of :mod:`specdec.kernels.rejection`'s kernels, and the input checks
their launchers share: :func:`rejection_sample_reference` (the general ``min(1, p/q)`` rule) and
:func:`verify_row_tokens_reference` (row-token mode), vectorised over the batch. The algorithms
and the noise they take are described in that module's docstring; fed the same noise, a kernel
and its reference emit the same tokens (``tests/kernels/test_rejection.py``).
"""

from __future__ import annotations

import torch

from specdec.kernels.launch_checks import check_tensors

PROB_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def verify_row_tokens_reference(
    draft_token_ids: torch.Tensor,  # [T] int64
    cu_num_draft_tokens: torch.Tensor,  # [B] int64
    target_rows: torch.Tensor,  # [T + B, V]
    is_greedy: torch.Tensor,  # [B] bool
    row_noise: torch.Tensor,  # [T + B, V] float32
    max_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, max_k + 1] int64 (-1 padded), [B] int64
    """The specification of :func:`verify_row_tokens_triton`: every row's token at once, then
    each sequence's accepted prefix."""
    check_row_token_inputs(draft_token_ids, cu_num_draft_tokens, target_rows, is_greedy, row_noise)
    batch, device = cu_num_draft_tokens.numel(), target_rows.device
    k = torch.diff(cu_num_draft_tokens, prepend=cu_num_draft_tokens.new_zeros(1))  # [B]
    greedy = torch.repeat_interleave(is_greedy, k + 1).unsqueeze(1)  # [T + B, 1]
    rows = target_rows.float()
    row_token = torch.where(greedy, rows, rows / row_noise).argmax(dim=1).tolist()  # [T + B]
    drafts, counts = draft_token_ids.tolist(), k.tolist()
    output = torch.full((batch, max_k + 1), -1, dtype=torch.int64)
    num_accepted = torch.zeros(batch, dtype=torch.int64)
    first_draft = 0
    for i, num_drafts in enumerate(counts):
        first_row = first_draft + i  # sequence i has i bonus rows before its own
        j = 0
        while j < num_drafts and drafts[first_draft + j] == row_token[first_row + j]:
            j += 1
        output[i, : j + 1] = torch.tensor(row_token[first_row : first_row + j + 1])
        num_accepted[i] = j
        first_draft += num_drafts
    return output.to(device), num_accepted.to(device)


def check_row_token_inputs(
    draft_token_ids: torch.Tensor,  # [T]
    cu_num_draft_tokens: torch.Tensor,  # [B]
    target_rows: torch.Tensor,  # [T + B, V]
    is_greedy: torch.Tensor,  # [B]
    row_noise: torch.Tensor,  # [T + B, V]
) -> None:
    """Raise ValueError on a wrong dtype, shape, device or memory layout (no device sync)."""
    if target_rows.dim() != 2:
        raise ValueError(f"target_rows must be 2-D [T + B, V], got {tuple(target_rows.shape)}")
    num_drafts, batch = draft_token_ids.numel(), cu_num_draft_tokens.numel()
    rows = (num_drafts + batch, target_rows.shape[1])
    check_tensors(
        {
            "draft_token_ids": (draft_token_ids, (num_drafts,), (torch.int64,)),
            "cu_num_draft_tokens": (cu_num_draft_tokens, (batch,), (torch.int64,)),
            "target_rows": (target_rows, rows, PROB_DTYPES),
            "is_greedy": (is_greedy, (batch,), (torch.bool,)),
            "row_noise": (row_noise, rows, (torch.float32,)),
        },
        "target_rows",
    )


def check_inputs(
    draft_token_ids: torch.Tensor,  # [T]
    cu_num_draft_tokens: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [T, V]
    target_probs: torch.Tensor,  # [T + B, V]
    is_greedy: torch.Tensor,  # [B]
    accept_uniforms: torch.Tensor,  # [T]
    race_exponentials: torch.Tensor,  # [B, V]
) -> None:
    """Raise ValueError on a wrong dtype, shape, device or memory layout (no device sync)."""
    if target_probs.dim() != 2:
        raise ValueError(
            f"target_probs must be 2-D [T + B, V], got shape {tuple(target_probs.shape)}"
        )
    num_drafts, batch = draft_token_ids.numel(), cu_num_draft_tokens.numel()
    vocab = target_probs.shape[1]
    expected = {
        "draft_token_ids": (draft_token_ids, (num_drafts,), (torch.int64,)),
        "cu_num_draft_tokens": (cu_num_draft_tokens, (batch,), (torch.int64,)),
        "target_probs": (target_probs, (num_drafts + batch, vocab), PROB_DTYPES),
        "is_greedy": (is_greedy, (batch,), (torch.bool,)),
        "accept_uniforms": (accept_uniforms, (num_drafts,), (torch.float64,)),
        "race_exponentials": (race_exponentials, (batch, vocab), (torch.float64,)),
    }
    if draft_probs is not None:
        expected["draft_probs"] = (draft_probs, (num_drafts, vocab), PROB_DTYPES)
    check_tensors(expected, "target_probs")


def rejection_sample_reference(
    draft_token_ids: torch.Tensor,  # [T] int64
    cu_num_draft_tokens: torch.Tensor,  # [B] int64
    draft_probs: torch.Tensor | None,  # [T, V] or None (one-hot q)
    target_probs: torch.Tensor,  # [T + B, V]
    is_greedy: torch.Tensor,  # [B] bool
    accept_uniforms: torch.Tensor,  # [T] float64
    race_exponentials: torch.Tensor,  # [B, V] float64
    max_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, max_k + 1] int64 (-1 padded), [B] int64
    """The specification the kernel is tested against, vectorised over the whole batch."""
    check_inputs(
        draft_token_ids,
        cu_num_draft_tokens,
        draft_probs,
        target_probs,
        is_greedy,
        accept_uniforms,
        race_exponentials,
    )
    batch, num_drafts = cu_num_draft_tokens.numel(), draft_token_ids.numel()
    device = target_probs.device
    k = torch.diff(cu_num_draft_tokens, prepend=cu_num_draft_tokens.new_zeros(1))  # [B]
    seq_of_draft = torch.repeat_interleave(torch.arange(batch, device=device), k)  # [T]
    draft_rows = torch.arange(num_drafts, device=device)  # [T]
    position = draft_rows - (cu_num_draft_tokens - k)[seq_of_draft]  # [T] j within its sequence
    target_rows = draft_rows + seq_of_draft  # [T]
    accept = _accept_drafts(
        draft_token_ids,
        draft_probs,
        target_probs,
        target_rows,
        is_greedy[seq_of_draft],
        accept_uniforms,
    )  # [T]
    accepted = torch.zeros(batch, max_k, dtype=torch.long, device=device)
    accepted[seq_of_draft, position] = accept.long()
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # [B] length of the accepted prefix
    final = _final_tokens(
        draft_token_ids,
        cu_num_draft_tokens - k,
        k,
        num_accepted,
        draft_probs,
        target_probs,
        is_greedy,
        race_exponentials,
    )  # [B]
    output = torch.full((batch, max_k + 1), -1, dtype=torch.int64, device=device)
    keep = position < num_accepted[seq_of_draft]  # [T]
    output[seq_of_draft[keep], position[keep]] = draft_token_ids[keep]
    output[torch.arange(batch, device=device), num_accepted] = final
    return output, num_accepted


def _accept_drafts(
    draft_token_ids: torch.Tensor,  # [T]
    draft_probs: torch.Tensor | None,  # [T, V]
    target_probs: torch.Tensor,  # [T + B, V]
    target_rows: torch.Tensor,  # [T] row of p at each draft position
    greedy: torch.Tensor,  # [T] bool, the draft's sequence is greedy
    accept_uniforms: torch.Tensor,  # [T] float64
) -> torch.Tensor:  # [T] bool, the draft passes its own test (ignoring earlier rejections)
    rows = torch.arange(draft_token_ids.numel(), device=draft_token_ids.device)  # [T]
    p_d = target_probs[target_rows, draft_token_ids].float().double()  # [T]
    q_d = torch.ones_like(p_d)  # [T] one-hot q
    if draft_probs is not None:
        q_d = draft_probs[rows, draft_token_ids].float().double()
    accept = (p_d > 0) & (accept_uniforms * q_d <= p_d)  # [T]
    # Greedy drafts must equal the argmax, the first index among ties, as in the kernel.
    argmax = target_probs[target_rows[greedy]].float().argmax(dim=-1)  # [T_greedy]
    accept[greedy] = argmax == draft_token_ids[greedy]
    return accept


def _final_tokens(
    draft_token_ids: torch.Tensor,  # [T]
    draft_start: torch.Tensor,  # [B] first draft row of each sequence
    k: torch.Tensor,  # [B] number of drafts
    num_accepted: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [T, V]
    target_probs: torch.Tensor,  # [T + B, V]
    is_greedy: torch.Tensor,  # [B] bool
    race_exponentials: torch.Tensor,  # [B, V] float64
) -> torch.Tensor:  # [B] the recovered, bonus or greedy token of each sequence
    batch = k.numel()
    seqs = torch.arange(batch, device=k.device)
    p = target_probs[draft_start + seqs + num_accepted].float()  # [B, V]
    residual = ~is_greedy & (num_accepted < k)  # [B] a random row that rejected a draft
    q = torch.zeros_like(p)  # [B, V]
    rows = (draft_start + num_accepted)[residual]  # draft rows of the rejected drafts
    if draft_probs is None:
        q[seqs[residual], draft_token_ids[rows]] = 1.0
    else:
        q[residual] = draft_probs[rows].float()
    # Greedy rows take the argmax of the raw values (they may be logits); their noise is unread.
    return torch.where(is_greedy, p.argmax(dim=1), _race(p, q, race_exponentials))


def _race(
    p: torch.Tensor,  # [N, V] float32
    q: torch.Tensor,  # [N, V] float32, zero where nothing is subtracted
    noise: torch.Tensor,  # [N, V] float64 Exp(1) noise
) -> torch.Tensor:  # [N] int64
    """Exponential race over max(0, p - q), falling back to p where that is all zero."""
    r = (p - q).clamp_min(0.0)  # [N, V]
    score_r = torch.where(r > 0, r.double() / noise, 0.0)  # [N, V]
    best_r, token = score_r.max(dim=1)  # [N], the first index of the max, as in the kernel
    fallback = best_r <= 0  # [N] rows whose residual is all zero
    if bool(fallback.any()):
        p_f = p[fallback]  # [F, V]
        score_p = torch.where(p_f > 0, p_f.double() / noise[fallback], 0.0)  # [F, V]
        token[fallback] = score_p.argmax(dim=1)
    return token
