"""Exact batched verification of drafts by rejection sampling.

One call decides, for every sequence of the batch, which of its drafts to keep and samples the one
token the target adds, so that the emitted tokens follow exactly the distribution the target alone
would produce (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").

Terms:
    draft: a token ``d_j`` proposed for position ``j`` of a sequence, with draft distribution
        ``q_j`` (one-hot at ``d_j`` for a deterministic drafter, which passes no draft probs).
    accepted token: a draft kept, with probability ``min(1, p_j(d_j) / q_j(d_j))``, tested in
        order; a greedy row keeps a draft while it equals ``argmax p_j``.
    recovered token: the token emitted at the first rejected position, drawn from
        ``norm(max(0, p_j - q_j))`` (the argmax for a greedy row); the sequence ends there.
    bonus token: the token drawn from ``p_k`` at the position after the last draft, when all ``k``
        drafts were accepted. A sequence with no drafts emits only its bonus token, which is
        exactly plain sampling.

Each sequence emits its accepted drafts and then one recovered or bonus token.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.kernels.rejection import rejection_sample_triton
from specdec.kernels.rejection_reference import rejection_sample_reference

BACKENDS = ("triton", "torch")
BACKEND_ENV = "SPECDEC_VERIFY_BACKEND"  # forces a backend when the call names none


@dataclass(slots=True)
class VerifyUniforms:
    """The randomness of one verification call, float64 so rounding cannot bias a test.

    Both backends read only these tensors, so a test that feeds the same ``VerifyUniforms`` to the
    Triton kernel and to the torch reference must see the same tokens. Greedy rows read nothing.
    """

    accept: torch.Tensor  # [T] float64 in [0, 1): u_j of each draft's accept test
    race: torch.Tensor  # [B, V] float64 Exp(1): noise of each sequence's recovered-or-bonus race

    def __post_init__(self) -> None:
        if self.accept.dtype != torch.float64 or self.race.dtype != torch.float64:
            raise ValueError("VerifyUniforms tensors must be float64")


@dataclass(slots=True)
class VerifyOutput:
    """The tokens each sequence emits, and which drafts were accepted."""

    output_token_ids: torch.Tensor  # [B, max_k + 1] int64: accepted drafts, recovered/bonus, -1s
    num_accepted: torch.Tensor  # [B] int64: accepted drafts, not counting recovered/bonus
    accepted_mask: torch.Tensor  # [B, max_k] bool: draft j of sequence i was accepted

    def __post_init__(self) -> None:
        batch, width = self.output_token_ids.shape
        if self.num_accepted.shape != (batch,) or self.accepted_mask.shape != (batch, width - 1):
            raise ValueError("VerifyOutput fields disagree on the batch size or max_k")

    @property
    def num_emitted_tokens(self) -> torch.Tensor:  # [B] int64
        """Tokens each sequence gains this step: its accepted drafts and one more."""
        return self.num_accepted + 1


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [T] int32/int64, drafts of all sequences back to back
    cu_num_draft_tokens: torch.Tensor,  # [B] int32/int64, inclusive cumulative sum of k_i
    draft_probs: torch.Tensor | None,  # [T, V] float, or None for a deterministic drafter
    target_probs: torch.Tensor,  # [T + B, V] float, k_i + 1 rows per sequence
    is_greedy: torch.Tensor,  # [B] bool
    generators: Sequence[torch.Generator | None] | None = None,  # [B] generator or None each
    uniforms: VerifyUniforms | None = None,  # randomness to use instead of drawing it
    backend: str | None = None,  # "triton", "torch", or None (see below)
) -> VerifyOutput:
    """Verify every sequence's drafts in one pass.

    ``target_probs`` holds, for sequence ``i``, one row per draft position and then its bonus
    position: rows ``cu[i-1] + i .. cu[i] + i``. They must come from
    :func:`specdec.sampling.process_logits`, the function plain sampling uses, so temperature,
    top-k, top-p and min-p shape ``p`` identically with and without speculation. Greedy rows are
    only compared by argmax, so they may hold the raw logits instead.

    Randomness: unless ``uniforms`` is given, :func:`draw_uniforms` draws it; a sequence with a
    generator draws only from that generator, so its tokens do not depend on the rest of the batch.
    Backend: ``backend``, else ``$SPECDEC_VERIFY_BACKEND``, else the Triton kernel for CUDA
    tensors and the torch reference elsewhere. Both give the same tokens for the same randomness.
    """
    if draft_token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"draft_token_ids must be int32 or int64, got {draft_token_ids.dtype}")
    if cu_num_draft_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_num_draft_tokens must be int32 or int64, got {cu_num_draft_tokens.dtype}"
        )
    draft_token_ids, cu_num_draft_tokens = draft_token_ids.long(), cu_num_draft_tokens.long()
    num_drafts, greedy = _host_layout(draft_token_ids, cu_num_draft_tokens, target_probs, is_greedy)
    if uniforms is None:
        uniforms = _draw(num_drafts, greedy, target_probs.shape[1], generators, target_probs.device)
    use_triton = select_backend(backend, target_probs.device) == "triton"
    implementation = rejection_sample_triton if use_triton else rejection_sample_reference
    max_k = max(num_drafts, default=0)
    output_token_ids, num_accepted = implementation(
        draft_token_ids,
        cu_num_draft_tokens,
        draft_probs,
        target_probs,
        is_greedy,
        uniforms.accept,
        uniforms.race,
        max_k,
    )
    positions = torch.arange(max_k, device=num_accepted.device)  # [max_k]
    accepted_mask = positions.unsqueeze(0) < num_accepted.unsqueeze(1)  # [B, max_k]
    return VerifyOutput(output_token_ids, num_accepted, accepted_mask)


def draw_uniforms(
    cu_num_draft_tokens: torch.Tensor,  # [B] int, inclusive cumulative sum of k_i
    is_greedy: torch.Tensor,  # [B] bool
    vocab_size: int,
    generators: Sequence[torch.Generator | None] | None = None,  # [B]
) -> VerifyUniforms:
    """Draw the randomness of one verification call, as :func:`rejection_sample` does.

    A random (non-greedy) sequence with a generator draws, from that generator only, ``k_i``
    uniforms and then ``V`` exponentials; one with ``k_i = 0`` draws only the exponentials its bonus
    token needs. Sequences without a generator share one draw from the global RNG of the device.
    Greedy sequences draw nothing; their entries are placeholders (0 and 1) that are never read.
    """
    k = torch.diff(cu_num_draft_tokens.long(), prepend=cu_num_draft_tokens.new_zeros(1).long())
    greedy = [bool(g) for g in is_greedy.tolist()]
    return _draw(k.tolist(), greedy, vocab_size, generators, cu_num_draft_tokens.device)


def _draw(
    num_drafts: list[int],  # [B] k_i
    greedy: list[bool],  # [B]
    vocab_size: int,
    generators: Sequence[torch.Generator | None] | None,
    device: torch.device,
) -> VerifyUniforms:
    batch, f64 = len(num_drafts), torch.float64
    generators = [None] * batch if generators is None else generators
    if len(generators) != batch:
        raise ValueError(f"got {len(generators)} generators for a batch of {batch}")
    starts = [0, *itertools.accumulate(num_drafts)][:batch]  # [B] first draft row of each sequence
    accept = torch.zeros(sum(num_drafts), dtype=f64, device=device)  # [T]
    race = torch.ones(batch, vocab_size, dtype=f64, device=device)  # [B, V]
    shared = [not g and gen is None for g, gen in zip(greedy, generators)]  # [B] global RNG rows
    if any(shared):
        # Boolean masks built on the host, so the draw sizes need no device sync.
        counts = torch.tensor(num_drafts, dtype=torch.long)  # [B]
        shared_rows = torch.tensor(shared)  # [B]
        shared_drafts = shared_rows.repeat_interleave(counts)  # [T]
        num_shared_drafts = int(counts[shared_rows].sum())
        accept[shared_drafts.to(device)] = torch.rand(num_shared_drafts, dtype=f64, device=device)
        noise = torch.empty(sum(shared), vocab_size, dtype=f64, device=device).exponential_()
        race[shared_rows.to(device)] = noise
    for i, gen in enumerate(generators):
        if gen is None or greedy[i]:
            continue
        if num_drafts[i] > 0:
            own = torch.rand(num_drafts[i], generator=gen, dtype=f64, device=gen.device)
            accept[starts[i] : starts[i] + num_drafts[i]] = own.to(device)
        noise = torch.empty(vocab_size, dtype=f64, device=gen.device).exponential_(generator=gen)
        race[i] = noise.to(device)
    return VerifyUniforms(accept, race)


def _host_layout(
    draft_token_ids: torch.Tensor,  # [T] int64
    cu_num_draft_tokens: torch.Tensor,  # [B] int64
    target_probs: torch.Tensor,  # [T + B, V]
    is_greedy: torch.Tensor,  # [B] bool
) -> tuple[list[int], list[bool]]:  # k_i and is_greedy on the host
    """Copy what the host needs in one device sync, checking values no launcher can check cheaply."""
    if cu_num_draft_tokens.dim() != 1 or is_greedy.shape != cu_num_draft_tokens.shape:
        raise ValueError("cu_num_draft_tokens and is_greedy must both have shape [B]")
    if draft_token_ids.dim() != 1 or target_probs.dim() != 2:
        raise ValueError("draft_token_ids must be [T] and target_probs [T + B, V]")
    batch, vocab = cu_num_draft_tokens.numel(), target_probs.shape[1]
    k = torch.diff(cu_num_draft_tokens, prepend=cu_num_draft_tokens.new_zeros(1))  # [B]
    ids = draft_token_ids if draft_token_ids.numel() else draft_token_ids.new_zeros(1)
    ranges = torch.stack([ids.min(), ids.max()])  # [2]
    host = torch.cat([k, is_greedy.long(), ranges]).tolist()
    num_drafts, greedy, (low, high) = host[:batch], host[batch : 2 * batch], host[2 * batch :]
    if min(num_drafts, default=0) < 0:
        raise ValueError("cu_num_draft_tokens must be non-decreasing (k_i >= 0)")
    if sum(num_drafts) != draft_token_ids.numel():
        raise ValueError(
            f"cu_num_draft_tokens ends at {sum(num_drafts)} but there are "
            f"{draft_token_ids.numel()} draft tokens"
        )
    if low < 0 or high >= vocab:
        raise ValueError(f"draft token ids must lie in [0, {vocab}), got [{low}, {high}]")
    return num_drafts, [bool(g) for g in greedy]


def select_backend(backend: str | None, device: torch.device) -> str:
    """``backend``, else ``$SPECDEC_VERIFY_BACKEND``, else ``"triton"`` on CUDA and ``"torch"``
    elsewhere; an unknown name raises ``ValueError``."""
    choice = (
        backend or os.environ.get(BACKEND_ENV) or ("triton" if device.type == "cuda" else "torch")
    )
    if choice not in BACKENDS:
        raise ValueError(f"unknown verification backend {choice!r}; choose one of {BACKENDS}")
    return choice
