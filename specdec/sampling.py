"""Logits processing and token sampling, shared by plain decoding and verification.

One function, :func:`process_logits`, turns raw logits into the distribution ``p`` that a request
samples from (temperature, then top-k, then top-p, then min-p, in the order Hugging Face
transformers applies its warpers). The plain sampler draws from ``p`` and speculative verification
accepts drafts against the same ``p``, so decoding with and without speculation cannot drift apart.

Terms:
    greedy row: a request with ``temperature == 0``; it takes the argmax of the raw logits.
    generator: a per-request ``torch.Generator`` seeded from ``SamplingParams.seed``; a seeded row
        draws only from its own generator, so its output does not depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.config import SamplingParams


def process_logits(
    logits: torch.Tensor,  # [N, V] raw logits
    temperature: torch.Tensor,  # [N] float; 0 marks a greedy row (processed as temperature 1)
    top_k: torch.Tensor,  # [N] int; <= 0 or >= V disables
    top_p: torch.Tensor,  # [N] float in (0, 1]; 1 disables
    min_p: torch.Tensor,  # [N] float in [0, 1]; 0 disables
) -> torch.Tensor:  # [N, V] float32 probabilities
    """Return the sampling distribution of each row after temperature, top-k, top-p and min-p."""
    logits = logits.float()
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    logits = logits / temp.unsqueeze(1)
    vocab = logits.shape[1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    if bool(use_k.any()) or bool(use_p.any()):
        logits = _top_k_top_p(logits, top_k, top_p, use_k, use_p)
    probs = torch.softmax(logits, dim=-1)
    if bool((min_p > 0).any()):
        # min-p keeps tokens whose probability is at least min_p times the most likely one's.
        threshold = min_p.float().unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [N, 1]
        probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def process_logits_for(
    logits: torch.Tensor,  # [N, V] raw logits
    params: Sequence[SamplingParams],  # [N] the request of each row
) -> torch.Tensor:  # [N, V] float32 probabilities
    """:func:`process_logits` with each row's settings taken from its request."""
    return process_logits(
        logits,
        torch.tensor([p.temperature for p in params]),
        torch.tensor([p.top_k for p in params]),
        torch.tensor([p.top_p for p in params]),
        torch.tensor([p.min_p for p in params]),
    )


def _top_k_top_p(
    logits: torch.Tensor,  # [N, V] temperature-scaled logits
    top_k: torch.Tensor,  # [N]
    top_p: torch.Tensor,  # [N]
    use_k: torch.Tensor,  # [N] bool
    use_p: torch.Tensor,  # [N] bool
) -> torch.Tensor:  # [N, V] logits with removed tokens at -inf
    """Mask tokens outside the top-k and outside the smallest set with mass >= top_p."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
    k = torch.where(use_k, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)  # [N, 1]
    remove = ranks >= k  # [N, V] outside the top-k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [N, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V] mass of better tokens
    p = torch.where(use_p, top_p.float(), torch.ones_like(top_p, dtype=torch.float32))
    # A token is kept while the mass before it is still below top_p; the first token always stays.
    remove = remove | ((mass_before >= p.unsqueeze(1)) & (ranks > 0))
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(
    probs: torch.Tensor,  # [N, V] float probabilities
    generators: list[torch.Generator | None],  # [N] per-row generator or None (global RNG)
) -> torch.Tensor:  # [N] int64 sampled token ids
    """Draw one token per row by an exponential race: argmax_v p_v / E_v with E_v ~ Exp(1).

    The race picks ``v`` with probability ``p_v`` without normalising ``p``. Rows with a generator
    draw their noise from it alone, so a seeded request is reproducible whatever else runs.
    """
    noise = torch.empty_like(probs, dtype=torch.float32)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty(
            (len(unseeded), probs.shape[1]), device=probs.device
        ).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return (probs.float() / noise).argmax(dim=-1)
