"""The sampler draws from the processed distribution (a statistical test that can fail), with
noise keyed by (seed, position)."""

import numpy as np
import pytest
import torch
import transformers
from scipy.stats import chisquare

from specdec import SamplingParams
from specdec.sampling import (
    exponential_noise,
    noise_seed,
    process_logits,
    process_logits_for,
    row_argmax,
    sample,
    splitmix64,
)

LOGITS = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.3, 0.0, -0.2, -1.0, -3.0, 0.9, 1.2])
NUM_SAMPLES = 200_000


def expected_probs(temperature, top_k, top_p, min_p, exclusive_top_p=False):
    """An independent numpy statement of temperature -> top-k -> top-p -> min-p."""
    logits = LOGITS.double().numpy() / (temperature or 1.0)
    order = np.argsort(-logits)
    keep = np.zeros(len(logits), dtype=bool)
    keep[order[: top_k if top_k > 0 else len(logits)]] = True
    probs = np.where(keep, np.exp(logits - logits.max()), 0.0)
    probs /= probs.sum()
    mass = 0.0
    for rank, token in enumerate(order):
        if not keep[token]:
            continue
        # Correct rule: keep while the mass of better tokens is below top_p. The broken variant
        # drops the token that crosses top_p, a classic off-by-one.
        crossed = mass + probs[token] > top_p if exclusive_top_p else mass >= top_p
        if rank > 0 and crossed:
            keep[token] = False
        mass += probs[token]
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def draw(temperature, top_k, top_p, min_p, seed=0):
    n = NUM_SAMPLES
    probs = process_logits(
        LOGITS.repeat(n, 1),
        torch.full((n,), temperature),
        torch.full((n,), top_k),
        torch.full((n,), top_p),
        torch.full((n,), min_p),
    )
    tokens = sample(probs, [(seed, position) for position in range(n)])
    return np.bincount(tokens.numpy(), minlength=len(LOGITS))


def fits(counts, probs) -> float:
    """p-value that counts were drawn from probs; 0 if a token of probability 0 appeared."""
    if counts[probs == 0].sum():
        return 0.0
    support = probs > 0
    return chisquare(counts[support], probs[support] * counts.sum()).pvalue


CASES = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.0, 5, 1.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.3),
    (0.9, 8, 0.9, 0.05),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), CASES)
def test_samples_follow_the_processed_distribution(temperature, top_k, top_p, min_p):
    counts = draw(temperature, top_k, top_p, min_p)
    assert fits(counts, expected_probs(temperature, top_k, top_p, min_p)) > 1e-6


def test_the_check_detects_a_wrong_top_p():
    counts = draw(1.3, 0, 0.8, 0.0)
    wrong = expected_probs(1.3, 0, 0.8, 0.0, exclusive_top_p=True)
    assert fits(counts, wrong) < 1e-12


def test_process_logits_is_row_wise():
    rows = torch.stack([LOGITS, LOGITS.flip(0)])
    probs = process_logits(
        rows,
        torch.tensor([0.5, 1.0]),
        torch.tensor([3, 0]),
        torch.tensor([1.0, 0.5]),
        torch.tensor([0.0, 0.0]),
    )
    assert (probs[0] > 0).sum() == 3
    np.testing.assert_allclose(probs[0].numpy(), expected_probs(0.5, 3, 1.0, 0.0), atol=1e-6)


def test_a_rows_bits_do_not_depend_on_the_rest_of_the_batch():
    """Seeded sampling must not change with the batch: a row processed beside rows with other
    settings (min-p, top-k, top-p) has the bits it has alone."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 500, generator=gen) * 3
    settings = [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.1), (1.3, 20, 1.0, 0.0), (1.0, 0, 0.8, 0.0)]

    def processed(rows: list[int]) -> torch.Tensor:
        t, k, p, m = (torch.tensor(v) for v in zip(*[settings[r] for r in rows]))
        return process_logits(logits[rows], t, k, p, m)

    together = processed([0, 1, 2, 3])
    for row in range(4):
        assert torch.equal(together[row], processed([row])[0]), row


def test_noise_is_keyed_by_seed_and_position():
    keys = [(7, 3), (7, 4), (8, 3), (7, 3)]
    noise = exponential_noise(keys, 50)  # [4, 50]
    torch.manual_seed(123)  # the global RNG plays no part
    alone = exponential_noise([(7, 3)], 50)[0]
    assert torch.equal(noise[0], noise[3]) and torch.equal(noise[0], alone)
    assert not torch.equal(noise[0], noise[1])  # another position
    assert not torch.equal(noise[0], noise[2])  # another seed
    assert noise.dtype == torch.float32 and bool((noise > 0).all())


def test_noise_seed_mixes_seed_and_position():
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # SplitMix64's first output for seed 0
    assert noise_seed(7, 4) != noise_seed(8, 3)  # no collision along seed + position
    assert noise_seed(-1, 0) == noise_seed(2**64 - 1, 0)  # seeds are taken mod 2**64
    assert len({noise_seed(s, p) for s in range(50) for p in range(50)}) == 2500


def test_row_argmax_is_torchs_argmax_ties_nan_and_views_included():
    """The numpy path must pick what ``argmax(dim=-1)`` picks: the first of tied maxima, a NaN
    over any number, index 0 of a row of -inf, and the same through strided views."""
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor(
        [[1.0, nan, 3.0, nan], [-inf] * 4, [2.0, 5.0, 5.0, 1.0], [inf, 1.0, inf, 0.0]]
    )
    torch.manual_seed(0)
    wide = torch.randn(5, 2 * 49152).round(decimals=1)  # many ties
    for x in (rows, wide, wide[:, ::2], wide[1:4].T.contiguous().T, wide[:, 7:9]):
        assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert torch.equal(row_argmax(wide.bfloat16()), wide.bfloat16().argmax(dim=-1))  # torch's
    grad = wide.clone().requires_grad_()
    assert torch.equal(row_argmax(grad), wide.argmax(dim=-1))


def kept_reference(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """An independent float64 statement of the cut: the tokens at or above the k-th best logit,
    then at or above the least logit of the fewest best tokens whose mass reaches top_p."""
    order = np.sort(logits)[::-1]
    k_cut = order[top_k - 1] if 0 < top_k < len(logits) else -np.inf
    kept = np.where(order >= k_cut, np.exp(order - order.max()), 0.0)
    probs = kept / kept.sum()
    before = np.cumsum(probs) - probs
    n = max(1, int((before < top_p).sum())) if top_p < 1 else len(logits)
    return logits >= max(k_cut, order[n - 1])


def test_top_k_top_p_on_a_large_vocabulary_keep_what_the_definition_keeps():
    """Rows settled among the best 256 tokens, among 4,096, and only over the whole row (a flat
    distribution, top-k past 4,096), ties at the cut, each against the float64 reference and
    processed alone as in one batch."""
    gen = torch.Generator().manual_seed(1)
    vocab = 6000
    peaked = torch.randn(vocab, generator=gen) * 4
    flat = torch.randn(vocab, generator=gen) * 0.05
    tied = peaked.clone()
    tied[tied.topk(30).indices[20:]] = tied.topk(30).values[19]  # 11 logits tied at rank 20
    wide_tie = torch.zeros(vocab)  # the k-th logit tied far past the first 256 candidates:
    wide_tie[:10] = 2.0  # top-p must weigh every tied token, not just the candidates
    guided = torch.full((vocab,), float("-inf"))  # a guide allows three tokens
    guided[[5, 900, 4000]] = torch.tensor([1.0, 3.0, 2.0])
    settings = [  # (row, temperature, top_k, top_p)
        (peaked, 1.0, 0, 0.9), (peaked, 0.7, 40, 0.95), (flat, 1.0, 0, 0.5), (flat, 1.0, 0, 0.97),
        (peaked, 1.0, 300, 1.0), (flat, 1.0, 5000, 0.99), (tied, 1.0, 20, 1.0), (tied, 1.0, 0, 0.3),
        (peaked, 1.0, 0, 1.0), (wide_tie, 1.0, 100, 0.2), (guided, 1.0, 0, 0.999),
        (guided, 0.5, 2, 0.95), (peaked, 1.0, 0, 0.01),
    ]  # fmt: skip
    logits = torch.stack([row for row, *_ in settings])
    t, k, p = (torch.tensor(v) for v in list(zip(*settings))[1:])
    together = process_logits(logits, t, k, p, torch.zeros(len(settings)))
    for i, (row, temperature, top_k, top_p) in enumerate(settings):
        alone = process_logits(row[None], t[i : i + 1], k[i : i + 1], p[i : i + 1], torch.zeros(1))
        assert torch.equal(together[i], alone[0]), i
        want = kept_reference((row / temperature).double().numpy(), top_k, top_p)
        assert np.array_equal(together[i].numpy() > 0, want & np.isfinite(row.numpy())), i
    assert (together[6] > 0).sum() == 30  # the tied tokens stay together
    assert (together[9] > 0).sum() == vocab  # 10 tokens of mass 0.012 do not reach 0.2
    assert (together[10] > 0).sum() == 3 and (together[11] > 0).sum() == 2
    assert (together[12] > 0).sum() == 1  # top_p 0.01: the best token alone


@pytest.mark.parametrize(
    "typical_p, epsilon, eta",
    [(0.6, 0.0, 0.0), (1.0, 0.004, 0.0), (1.0, 0.0, 0.01), (0.9, 0.002, 0.02)],
)
def test_typical_epsilon_and_eta_keep_what_transformers_keeps(typical_p, epsilon, eta):
    """transformers' warpers after temperature, top-k, top-p and min-p, on rows of 500 logits
    of several spreads: the same tokens kept, the same probabilities; a row's bits alone are
    its bits in a batch with rows that use none of them."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 500, generator=gen) * torch.tensor([0.5, 1, 2, 3, 5, 8])[:, None]
    for temperature, top_k, top_p, min_p in [(1.0, 0, 1.0, 0.0), (0.7, 100, 0.95, 0.02)]:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                typical_p=typical_p, epsilon_cutoff=epsilon, eta_cutoff=eta)  # fmt: skip
        ours = process_logits_for(logits, [params] * len(logits))
        warpers = [transformers.TemperatureLogitsWarper(temperature)]
        warpers += [transformers.TopKLogitsWarper(top_k)] if top_k else []
        warpers += [transformers.TopPLogitsWarper(top_p), transformers.MinPLogitsWarper(min_p)]
        warpers += [transformers.TypicalLogitsWarper(typical_p)] if typical_p < 1 else []
        warpers += [transformers.EpsilonLogitsWarper(epsilon)] if epsilon else []
        warpers += [transformers.EtaLogitsWarper(eta)] if eta else []
        scores = logits.clone()
        for warper in warpers:
            scores = warper(None, scores)
        theirs = scores.softmax(dim=-1)
        assert torch.equal(ours > 0, theirs > 0)
        assert (ours > 0).sum(dim=1).lt(500).any()  # something was cut
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
        plain = SamplingParams(temperature=temperature)
        mixed = process_logits_for(logits[:2], [params, plain])
        assert torch.equal(mixed[0], ours[0])
