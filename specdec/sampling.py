"""Logits processing and token sampling, shared by plain decoding, drafting and verification.

One function, :func:`process_logits`, turns raw logits into the distribution ``p`` that a request
samples from (temperature, then top-k, then top-p, then min-p, in the order Hugging Face
transformers applies its warpers). One function, :func:`next_tokens`, says which token plain
decoding emits at a logit row; the verifier and the draft model both call it, so decoding with and
without speculation cannot drift apart.

Terms:
    greedy row: a request with ``temperature == 0``; it takes the argmax of the raw logits.
    position: the index in ``Sequence.token_ids`` that the sampled token will occupy.
    noise key: ``(seed, position)``; every sampled token of a request draws its randomness from
        the noise of its key alone (:func:`exponential_noise`), so a seeded request's tokens depend
        on its prompt, parameters and seed, not on the batch, the drafter or the draft depth.
    exponential race: the sampler; the token is ``argmax_v p_v / E_v`` over the row's noise ``E``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.config import SamplingParams
from specdec.kernels import cpu_ops
from specdec.kernels.cpu_ops import GOLDEN_GAMMA, MIX_MULTIPLIERS
from specdec.outputs import TokenLogprobs


def process_logits(
    logits: torch.Tensor,  # [N, V] raw logits
    temperature: torch.Tensor,  # [N] float; 0 marks a greedy row (processed as temperature 1)
    top_k: torch.Tensor,  # [N] int; <= 0 or >= V disables
    top_p: torch.Tensor,  # [N] float in (0, 1]; 1 disables
    min_p: torch.Tensor,  # [N] float in [0, 1]; 0 disables
    cutoffs: torch.Tensor | None = None,  # [N, 3] typical_p, epsilon, eta (see _cut_rows)
) -> torch.Tensor:  # [N, V] float32 probabilities
    """Return the sampling distribution of each row after temperature, top-k, top-p, min-p
    and, where ``cutoffs`` asks, transformers' typical, epsilon and eta warpers."""
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
        kept = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
        # Only rows that use min-p are renormalised: a row's bits must not depend on whether
        # another request of the batch asked for min-p.
        probs = torch.where((min_p > 0).unsqueeze(1), kept / kept.sum(dim=-1, keepdim=True), probs)
    if cutoffs is not None:
        used = ((cutoffs[:, 0] < 1) | (cutoffs[:, 1:] > 0).any(dim=1)).nonzero().squeeze(1)
        if len(used):  # only those rows, each alone: no row's bits depend on the batch
            cut = torch.cat([_cut_rows(probs[r : r + 1], cutoffs[r]) for r in used.tolist()])
            probs = probs.index_copy(0, used.to(probs.device), cut)
    return probs


def _cut_rows(
    probs: torch.Tensor,  # [1, V] a row's distribution so far
    cutoff: torch.Tensor,  # [3] typical_p (1 disables), epsilon, eta (0 disables)
) -> torch.Tensor:  # [1, V] renormalised
    """transformers' ``TypicalLogitsWarper`` (locally typical sampling, Meister et al., 2022:
    keep the tokens whose surprisal is nearest the entropy until their mass reaches
    ``typical_p``), then ``EpsilonLogitsWarper`` (drop tokens below probability ``epsilon``) and
    ``EtaLogitsWarper`` (below ``min(eta, sqrt(eta) * exp(-entropy))``; both Hewitt et al., 2022,
    truncation sampling), each keeping the best token, in that order, on the row's log
    probabilities (which those warpers read through softmaxes, so they are the same scores)."""
    scores = probs.log()
    typical, epsilon, eta = cutoff.tolist()
    if typical < 1:
        normalized = scores.log_softmax(dim=-1)
        entropy = -(normalized * normalized.exp()).nansum(-1, keepdim=True)
        shifted, order = torch.sort((-normalized - entropy).abs(), descending=False)
        mass = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (mass < typical).sum(dim=1).clamp_(max=shifted.shape[-1] - 1)
        drop = shifted > shifted.gather(1, last.view(-1, 1))
        drop[..., :1] = False  # the most typical token stays
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if epsilon > 0:
        scores = _drop_below(scores, epsilon)
    if eta > 0:  # in float32 tensors, as the warper computes its floor
        entropy = torch.distributions.Categorical(logits=scores).entropy()
        limit = torch.tensor(eta, dtype=torch.float32)
        scores = _drop_below(
            scores, torch.min(limit, limit.sqrt() * torch.exp(-entropy))[..., None]
        )
    return scores.softmax(dim=-1)


def _drop_below(scores: torch.Tensor, floor: float | torch.Tensor) -> torch.Tensor:
    """``-inf`` where a token's probability is below ``floor``, the best token kept."""
    drop = (scores.softmax(dim=-1) < floor) & (scores < scores.max(dim=-1, keepdim=True).values)
    return scores.masked_fill(drop, float("-inf"))


def process_logits_for(
    logits: torch.Tensor,  # [N, V] raw logits
    params: Sequence[SamplingParams],  # [N] the request of each row
) -> torch.Tensor:  # [N, V] float32 probabilities
    """:func:`process_logits` with each row's settings taken from its request."""
    settings = [(p.temperature, p.top_k, p.top_p, p.min_p) for p in params]
    temperature, top_k, top_p, min_p = torch.tensor(settings, dtype=torch.float64).T
    cutoffs = [(p.typical_p, p.epsilon_cutoff, p.eta_cutoff) for p in params]
    return process_logits(
        logits,
        temperature.float().to(logits.device),
        top_k.long().to(logits.device),
        top_p.float().to(logits.device),
        min_p.float().to(logits.device),
        torch.tensor(cutoffs, dtype=torch.float64)
        if any(c != (1, 0, 0) for c in cutoffs)
        else None,
    )


# A row's kept set is looked for among its best 256 tokens, then 4,096, then all of them: a full
# sort of the default model's 49,152 logits cost more than the decode step it followed.
CANDIDATES = (256, 4096)


def _top_k_top_p(
    logits: torch.Tensor,  # [N, V] temperature-scaled logits
    top_k: torch.Tensor,  # [N]
    top_p: torch.Tensor,  # [N]
    use_k: torch.Tensor,  # [N] bool
    use_p: torch.Tensor,  # [N] bool
) -> torch.Tensor:  # [N, V] logits with removed tokens at -inf
    """Mask tokens outside the top-k and outside the smallest set with mass >= top_p.

    Each row keeps the tokens at or above a *cut*, a logit value: the k-th best logit (top-k),
    and the least logit of the fewest best tokens whose mass, among those top-k keeps, reaches
    top_p (a token is kept while the mass of better tokens is below top_p; the best always
    stays). Tokens tied at the cut are all kept, as transformers' ``TopKLogitsWarper`` keeps
    them, so no sort's order of ties can change a row. The cut needs only the row's best
    tokens: it is taken from the best ``CANDIDATES[0]`` where they hold it, else from more. Which
    round settles a row depends on that row alone, so its bits never depend on the batch."""
    vocab = logits.shape[1]
    cut = torch.full((len(logits),), float("-inf"), device=logits.device)  # [N]
    pending = (use_k | use_p).nonzero().squeeze(1).tolist()
    k_of = torch.where(use_k, top_k, 0).tolist()  # [N] each row's k, 0 where top-k is off
    for size in (*(c for c in CANDIDATES if c < vocab), vocab):
        rows = [r for r in pending if size == vocab or k_of[r] <= size]
        if not rows:
            continue
        index = torch.tensor(rows, device=logits.device)
        settled, row_cut = _cut_among_best(
            logits[index], size, top_k[index], top_p[index], use_k[index], use_p[index]
        )
        cut[index[settled]] = row_cut[settled]
        done = set(index[settled].tolist())
        pending = [r for r in pending if r not in done]
        if not pending:
            break
    return torch.where(logits >= cut.unsqueeze(1), logits, float("-inf"))


def _cut_among_best(
    logits: torch.Tensor,  # [R, V] temperature-scaled logits
    size: int,  # how many of each row's best tokens to look at
    top_k: torch.Tensor,  # [R]
    top_p: torch.Tensor,  # [R]
    use_k: torch.Tensor,  # [R] bool
    use_p: torch.Tensor,  # [R] bool
) -> tuple[torch.Tensor, torch.Tensor]:  # [R] bool, [R] float32
    """Whether each row's cut lies among its best ``size`` tokens, and the cut where it does."""
    best = (
        logits.topk(size, dim=-1).values
        if size < logits.shape[1]
        else logits.sort(dim=-1, descending=True).values
    )  # [R, size] descending
    ranks = torch.arange(size, device=logits.device)  # [size]
    k = torch.where(use_k, top_k.clamp(1, size), torch.ones_like(top_k)) - 1  # [R] k-th rank
    k_cut = torch.where(use_k, best.gather(1, k.unsqueeze(1)).squeeze(1), float("-inf"))  # [R]
    # the mass top-p reads is that of the tokens top-k keeps: normalise over them alone
    kept_by_k = torch.where(best >= k_cut.unsqueeze(1), best, float("-inf"))
    norm = torch.where(
        use_k, torch.logsumexp(kept_by_k, dim=-1), torch.logsumexp(logits, dim=-1)
    )  # [R]
    probs = torch.exp(kept_by_k - norm.unsqueeze(1))  # [R, size]
    mass_before = probs.cumsum(dim=-1) - probs  # [R, size] mass of better tokens
    num_kept = ((mass_before < top_p.float().unsqueeze(1)) | (ranks == 0)).sum(dim=-1)  # [R]
    p_cut = torch.where(use_p, best.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1), k_cut)
    whole = size == logits.shape[1]
    # top-k is settled unless ties at the k-th value may run past the best `size`; top-p once a
    # token among them has better tokens of mass top_p before it
    k_settled = ~use_k | (best[:, -1] < k_cut) | whole
    p_settled = ~use_p | (num_kept < size) | whole
    return k_settled & p_settled, torch.maximum(k_cut, p_cut)


def row_argmax(rows: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N] int64
    """The index of each row's largest value, the first where it ties (a NaN counts as the
    largest), as ``rows.argmax(dim=-1)``. A float32 CPU tensor goes through numpy, whose argmax
    is vectorised where torch's CPU reduction is not: this runs on every logit row of every step
    (the README's Architecture section has the measurement)."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and not rows.requires_grad:
        return torch.from_numpy(rows.numpy().argmax(axis=-1))
    return rows.argmax(dim=-1)


def next_tokens(
    logits: torch.Tensor,  # [N, V] raw logits
    params: Sequence[SamplingParams],  # [N] the request of each row
    keys: Sequence[tuple[int, int]],  # [N] (seed, position) of each row's token
) -> list[int]:
    """The token plain decoding emits at each row: the argmax of the raw logits for a greedy row,
    else the race winner over :func:`process_logits_for`'s distribution with the row's noise."""
    tokens = row_argmax(logits)  # [N]
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled:
        probs = process_logits_for(logits[sampled], [params[i] for i in sampled])
        tokens[sampled] = sample(probs, [keys[i] for i in sampled])
    return tokens.tolist()


def sample(
    probs: torch.Tensor,  # [N, V] float probabilities (need not be normalised)
    keys: Sequence[tuple[int, int]],  # [N] (seed, position) of each row's token
) -> torch.Tensor:  # [N] int64 sampled token ids
    """Draw one token per row by an exponential race: ``argmax_v p_v / E_v`` with ``E_v ~ Exp(1)``.

    ``E_v / p_v`` is exponential with rate ``p_v``, and the first of independent exponential
    clocks rings at ``v`` with probability ``p_v / sum(p)``; taking logs, ``log p_v - log E_v``
    is ``log p_v`` plus Gumbel noise, so this is the Gumbel-max trick (Gumbel 1954; Maddison,
    Tarlow and Minka 2014, "A* Sampling"). Tokens with ``p_v = 0`` never win.
    """
    noise = exponential_noise(keys, probs.shape[1], probs.device)  # [N, V]
    return row_argmax(probs.float() / noise)


def exponential_noise(
    keys: Sequence[tuple[int, int]],  # [N] (seed, position) of each row
    vocab_size: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [N, V] float32 Exp(1) noise
    """The race noise of each key: ``V`` exponentials that are a function of
    :func:`noise_seed` ``(seed, position)`` and the token alone (counter-based SplitMix64, defined
    in :func:`specdec.kernels.cpu_ops.exponential_noise`), so a key always gets the same row,
    whatever else is drawn in the same call or before it, and on every CPU.

    float32: the race divides float32 probabilities, whose rounding (relative 2**-24) is that of
    the noise. The compiled kernel computes a row in one pass; a seeded ``torch.Generator`` per
    row, as before, cost about 20x as much at the default model's vocabulary (the torch
    reference, used where the kernel is unavailable, costs about as much as the generator did).
    """
    seeds = torch.tensor(
        [cpu_ops.as_int64(noise_seed(seed, position)) for seed, position in keys],
        dtype=torch.int64,
    )
    if torch.device(device).type == "cuda":  # drawn where it is used (specdec/kernels/noise.py)
        from specdec.kernels.noise import exponential_noise_triton  # triton: only on CUDA

        return exponential_noise_triton(seeds.to(device, non_blocking=True), vocab_size)
    return cpu_ops.exponential_noise(seeds, vocab_size).to(device)


def token_logprobs(
    logits: torch.Tensor,  # [n, V] the raw logit rows the tokens were decided from
    tokens: list[int],  # [n] the token each row emitted
    num_top: int,  # alternatives per token
) -> list[TokenLogprobs]:
    """Each token's log-probability, rank and the ``num_top`` most likely tokens at its row,
    under the model's raw distribution (``log_softmax`` of the logits, in float32)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)]
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0],) * 2
    return [
        TokenLogprobs(token, logprob, rank, tuple(zip(ids, values, strict=True)))
        for token, logprob, rank, ids, values in zip(
            tokens, chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist(),
            strict=True,
        )
    ]  # fmt: skip


_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, position: int) -> int:
    """The 64-bit noise key of ``(seed, position)``: ``splitmix64(splitmix64(seed) +
    position)``, so that neighbouring seeds and positions get unrelated keys (a plain
    ``seed + position`` would give ``(s, p + 1)`` the noise of ``(s + 1, p)``)."""
    return splitmix64(splitmix64(seed) + position)


def splitmix64(x: int) -> int:
    """The first output of SplitMix64 seeded with ``x`` (Steele, Lea and Flood 2014, "Fast
    splittable pseudorandom number generators"; Vigna's reference ``splitmix64.c``): a bijective
    mix of 64 bits in which every input bit flips each output bit with probability about 1/2."""
    z = (x + GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * MIX_MULTIPLIERS[0]) & _MASK64
    z = ((z ^ (z >> 27)) * MIX_MULTIPLIERS[1]) & _MASK64
    return z ^ (z >> 31)
