"""specdec.verify: exactness under sampling, greedy chains, seeded randomness, backend switches."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

if not torch.cuda.is_available():  # the Triton backend runs in Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from scipy import stats  # noqa: E402

from specdec import verify  # noqa: E402
from specdec.sampling import process_logits  # noqa: E402
from specdec.verify import VerifyOutput, draw_uniforms, rejection_sample  # noqa: E402

VerifyFn = Callable[..., VerifyOutput]
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]
NUM_TRIALS = 100_000
EXACT_P_VALUE = 1e-6  # a correct sampler fails this about once in a million seeds


@dataclass
class Scenario:
    """Two draft positions and a bonus, over a small vocabulary; position 1 depends on token 0."""

    p0: torch.Tensor  # [V] target at position 0
    p1: torch.Tensor  # [V, V] target at position 1 given token 0
    p2: torch.Tensor  # [V] target at the bonus position
    q0: torch.Tensor  # [V] draft distribution at position 0
    q1: torch.Tensor  # [V, V] draft distribution at position 1 given token 0
    stochastic: bool  # drafts sampled from q (draft probs given) or argmax q (deterministic)


def make_scenario(far: bool, stochastic: bool, vocab: int = 8) -> Scenario:
    gen = torch.Generator().manual_seed(1)

    def dist(*shape: int) -> torch.Tensor:  # [*shape, V], every entry at least 0.2 / V
        return 0.8 * torch.softmax(torch.randn(*shape, vocab, generator=gen), -1) + 0.2 / vocab

    p0, p1, p2 = dist(), dist(vocab), dist()
    if far:  # q favours what p disfavours and never proposes p's two likeliest tokens
        q0, q1 = p0.pow(-2), p1.pow(-2)
        q0[p0.topk(2).indices] = 0
        q1.scatter_(-1, p1.topk(2, dim=-1).indices, 0)
    else:
        q0 = p0 * torch.exp(0.3 * torch.randn(vocab, generator=gen))
        q1 = p1 * torch.exp(0.3 * torch.randn(vocab, vocab, generator=gen))
    q0, q1 = q0 / q0.sum(), q1 / q1.sum(-1, keepdim=True)
    return Scenario(p0, p1, p2, q0, q1, stochastic)


def propose(scenario: Scenario, q: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N] drafts
    if scenario.stochastic:
        return torch.multinomial(q, 1).squeeze(1)
    return q.argmax(dim=-1)


def first_two_tokens(verify_fn: VerifyFn, s: Scenario, num_trials: int) -> tuple:  # [N], [N]
    """Run every trial as one sequence of a batch; a sequence that rejects d_0 runs one more step."""
    vocab = s.p0.numel()
    d0 = propose(s, s.q0.expand(num_trials, vocab))  # [N]
    d1 = propose(s, s.q1[d0])  # [N]
    target = torch.stack([s.p0.expand(num_trials, vocab), s.p1[d0], s.p2.expand_as(s.p1[d0])], 1)
    draft_probs = torch.stack([s.q0.expand(num_trials, vocab), s.q1[d0]], 1).reshape(-1, vocab)
    out = verify_fn(
        torch.stack([d0, d1], 1).reshape(-1),
        torch.arange(1, num_trials + 1) * 2,
        draft_probs if s.stochastic else None,
        target.reshape(-1, vocab),  # [3N, V]: p0, p1 | d0, p2 per trial
        torch.zeros(num_trials, dtype=torch.bool),
    )
    tokens = out.output_token_ids[:, :2].clone()  # [N, 2]
    redo = out.num_accepted == 0  # token 0 was recovered, so token 1 comes from the next step
    first = tokens[redo, 0]
    count = first.numel()
    out = verify_fn(
        propose(s, s.q1[first]),
        torch.arange(1, count + 1),
        s.q1[first] if s.stochastic else None,
        torch.stack([s.p1[first], s.p2.expand(count, vocab)], 1).reshape(-1, vocab),
        torch.zeros(count, dtype=torch.bool),
    )
    tokens[redo, 1] = out.output_token_ids[:, 0]
    return tokens[:, 0], tokens[:, 1]


def exactness_p_values(verify_fn: VerifyFn, s: Scenario, seed: int = 0) -> tuple[float, float]:
    """Chi-square p-values of the first token against p0 and of the first pair against p0 * p1."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        first, second = first_two_tokens(verify_fn, s, NUM_TRIALS)
    vocab = s.p0.numel()
    pair_probs = (s.p0.double().unsqueeze(1) * s.p1.double()).flatten()  # [V * V]
    p_values = []
    for observed, probs in [(first, s.p0.double()), (first * vocab + second, pair_probs)]:
        counts = torch.bincount(observed, minlength=probs.numel()).double()
        expected = probs / probs.sum() * NUM_TRIALS
        p_values.append(float(stats.chisquare(counts.numpy(), expected.numpy()).pvalue))
    return p_values[0], p_values[1]


def torch_backend(*args: torch.Tensor | None) -> VerifyOutput:
    drafts, cu, draft_probs, target, is_greedy = args
    assert drafts is not None and cu is not None and target is not None and is_greedy is not None
    return rejection_sample(drafts, cu, draft_probs, target, is_greedy, backend="torch")


def on_device(*args: torch.Tensor | None) -> VerifyOutput:
    """The default backend on CUDA tensors: the Triton kernel (too slow interpreted for 100k rows)."""
    drafts, cu, draft_probs, target, is_greedy = (a.cuda() if a is not None else None for a in args)
    assert drafts is not None and cu is not None and target is not None and is_greedy is not None
    out = rejection_sample(drafts, cu, draft_probs, target, is_greedy)
    return VerifyOutput(out.output_token_ids.cpu(), out.num_accepted.cpu(), out.accepted_mask.cpu())


BACKENDS = [
    pytest.param(torch_backend, id="torch"),
    pytest.param(
        on_device,
        id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"),
    ),
]


@pytest.mark.parametrize("verify_fn", BACKENDS)
@pytest.mark.parametrize("far", [False, True], ids=["close", "far"])
@pytest.mark.parametrize("stochastic", [True, False], ids=["draft-probs", "deterministic"])
def test_emitted_tokens_follow_the_target_distribution(
    verify_fn: VerifyFn, far: bool, stochastic: bool
) -> None:
    p_first, p_pair = exactness_p_values(verify_fn, make_scenario(far, stochastic))
    assert p_first > EXACT_P_VALUE and p_pair > EXACT_P_VALUE


def accept_always(
    drafts: torch.Tensor,
    cu: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target: torch.Tensor,
    is_greedy: torch.Tensor,
) -> VerifyOutput:
    """Broken rule: every draft is kept (p made one-hot at the draft); the bonus token is exact."""
    rows = torch.arange(drafts.numel()) + torch.repeat_interleave(
        torch.arange(cu.numel()), torch.diff(cu, prepend=cu.new_zeros(1))
    )
    target = target.clone()
    target[rows] = torch.nn.functional.one_hot(drafts, target.shape[1]).float()
    return torch_backend(drafts, cu, None, target, is_greedy)


def recover_from_target(
    drafts: torch.Tensor,
    cu: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target: torch.Tensor,
    is_greedy: torch.Tensor,
) -> VerifyOutput:
    """Broken rule: the recovered token is drawn from p instead of norm(max(0, p - q))."""
    out = torch_backend(drafts, cu, draft_probs, target, is_greedy)
    k = torch.diff(cu, prepend=cu.new_zeros(1))  # [B]
    rejected = torch.nonzero(out.num_accepted < k).squeeze(1)  # [R]
    position = out.num_accepted[rejected]  # [R]
    row = cu[rejected] - k[rejected] + rejected + position  # [R] target row of each rejection
    out.output_token_ids[rejected, position] = torch.multinomial(target[row], 1).squeeze(1)
    return out


@pytest.mark.parametrize(
    ("broken", "far"),
    [(accept_always, False), (recover_from_target, True)],
    ids=["accept-always", "recover-from-p"],
)
def test_exactness_check_detects_a_broken_rule(broken: VerifyFn, far: bool) -> None:
    p_first, p_pair = exactness_p_values(broken, make_scenario(far, stochastic=True))
    assert min(p_first, p_pair) < 1e-12


def greedy_batch(batch: int, max_k: int, vocab: int, seed: int = 0) -> Batch:
    """Greedy rows whose drafts follow the target argmax for a random number of positions."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(0, max_k + 1, (batch,), generator=gen)  # [B]
    cu = k.cumsum(0).int()  # int32 on purpose: the front accepts it
    rows = int(cu[-1]) + batch
    logits = torch.randn(rows, vocab, generator=gen)  # [T + B, V]
    zero = torch.zeros(rows)
    target = process_logits(logits, zero, zero.long(), zero + 1, zero)  # temperature 0 = greedy
    draft_rows = torch.arange(int(cu[-1])) + torch.repeat_interleave(torch.arange(batch), k)
    argmax = target[draft_rows].argmax(-1)  # [T]
    matches = torch.rand(argmax.shape, generator=gen) < 0.8
    drafts = torch.where(matches, argmax, (argmax + 1) % vocab)  # [T]
    return drafts.int(), cu, None, target, torch.ones(batch, dtype=torch.bool)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_rows_emit_the_argmax_chain(backend: str) -> None:
    drafts, cu, _, target, greedy = greedy_batch(9, 5, 37)
    # the compiled kernel takes CUDA tensors; without CUDA it runs interpreted on these
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    on = [t.to(device) for t in (drafts, cu, target, greedy)]
    out = rejection_sample(on[0], on[1], None, on[2], on[3], backend=backend)
    start = 0
    for i, end in enumerate(cu.tolist()):
        chain = []  # the argmax chain up to and including the first mismatch (or the bonus)
        for j in range(end - start + 1):
            chain.append(int(target[start + i + j].argmax()))
            if j == end - start or chain[-1] != int(drafts[start + j]):
                break
        row = out.output_token_ids[i].tolist()
        assert row[: len(chain)] == chain and set(row[len(chain) :]) <= {-1}
        assert out.num_accepted[i] == len(chain) - 1
        start = end


def random_batch(batch: int, k: int, vocab: int, seed: int) -> Batch:
    """Random rows, k drafts each, drawn from their draft distributions."""
    gen = torch.Generator().manual_seed(seed)
    cu = torch.arange(1, batch + 1) * k  # [B]
    target = torch.softmax(torch.randn(batch * (k + 1), vocab, generator=gen), -1)  # [T + B, V]
    draft_probs = torch.softmax(torch.randn(batch * k, vocab, generator=gen), -1)  # [T, V]
    drafts = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)  # [T]
    return drafts, cu, draft_probs, target, torch.zeros(batch, dtype=torch.bool)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_seeded_rows_do_not_depend_on_the_batch(backend: str) -> None:
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("compiled, the kernel needs CUDA tensors, not CPU generators' draws there")
    alone = random_batch(1, 3, 29, seed=5)
    others = random_batch(4, 3, 29, seed=6)
    alone_probs, other_probs = alone[2], others[2]
    assert alone_probs is not None and other_probs is not None
    mixed = (  # the sequence of `alone` as row 2 of 5
        torch.cat([others[0][:6], alone[0], others[0][6:]]),
        torch.arange(1, 6) * 3,
        torch.cat([other_probs[:6], alone_probs, other_probs[6:]]),
        torch.cat([others[3][:8], alone[3], others[3][8:]]),
        torch.zeros(5, dtype=torch.bool),
    )
    gens = [torch.Generator().manual_seed(seed) for seed in (7, 7, 8, 7)]
    single = rejection_sample(*alone, generators=[gens[0]], backend=backend)
    again = rejection_sample(*alone, generators=[gens[1]], backend=backend)
    batched = rejection_sample(
        *mixed, generators=[gens[2], None, gens[3], None, None], backend=backend
    )
    assert torch.equal(single.output_token_ids, again.output_token_ids)
    assert torch.equal(batched.output_token_ids[2], single.output_token_ids[0])


def test_draws_only_what_each_row_needs() -> None:
    vocab = 11
    gens = [torch.Generator().manual_seed(3) for _ in range(3)]
    twins = [torch.Generator().manual_seed(3) for _ in range(3)]
    cu, greedy = torch.tensor([2, 2, 4]), torch.tensor([False, False, True])
    uniforms = draw_uniforms(cu, greedy, vocab, gens)
    torch.rand(2, generator=twins[0], dtype=torch.float64)  # row 0: two accept tests, then a race
    torch.empty(vocab, dtype=torch.float64).exponential_(generator=twins[0])
    torch.empty(vocab, dtype=torch.float64).exponential_(generator=twins[1])  # k = 0: race only
    for gen, twin in zip(gens, twins):  # row 2 is greedy: it draws nothing
        assert torch.equal(gen.get_state(), twin.get_state())
    assert uniforms.accept.shape == (4,) and uniforms.race.shape == (3, vocab)


def test_backends_agree_and_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel by default on CUDA
    batch = tuple(None if t is None else t.to(device) for t in random_batch(6, 4, 50, seed=0))
    uniforms = draw_uniforms(batch[1], batch[4], 50)
    kernel_calls = []
    kernel = verify.rejection_sample_triton

    def counted_kernel(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kernel_calls.append(args)
        return kernel(*args)

    monkeypatch.setattr(verify, "rejection_sample_triton", counted_kernel)
    monkeypatch.delenv(verify.BACKEND_ENV, raising=False)
    by_device = rejection_sample(*batch, uniforms=uniforms)  # the torch reference on the CPU
    assert len(kernel_calls) == int(torch.cuda.is_available())
    monkeypatch.setenv(verify.BACKEND_ENV, "triton")
    forced = rejection_sample(*batch, uniforms=uniforms)
    assert len(kernel_calls) == 1 + int(torch.cuda.is_available())
    assert torch.equal(forced.output_token_ids, by_device.output_token_ids)
    rejection_sample(*batch, uniforms=uniforms, backend="torch")  # the argument beats the variable
    assert len(kernel_calls) == 1 + int(torch.cuda.is_available())
    with pytest.raises(ValueError, match="unknown verification backend"):
        rejection_sample(*batch, backend="cuda")


def test_output_layout() -> None:
    cu = torch.tensor([3, 3, 6, 9, 15])  # k = 3, 0, 3, 3, 6
    gen = torch.Generator().manual_seed(0)
    target = torch.softmax(2 * torch.randn(20, 7, generator=gen), -1)  # [T + B, V]
    draft_probs = torch.softmax(2 * torch.randn(15, 7, generator=gen), -1)  # [T, V]
    drafts = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)  # [T]
    out = rejection_sample(drafts, cu, draft_probs, target, torch.zeros(5, dtype=torch.bool))
    assert out.output_token_ids.shape == (5, 7) and out.accepted_mask.shape == (5, 6)
    for i, (start, n) in enumerate(zip([0, 3, 3, 6, 9], out.num_accepted.tolist())):
        row = out.output_token_ids[i].tolist()
        assert row[:n] == drafts[start : start + n].tolist() and row[n] >= 0
        assert row[n + 1 :] == [-1] * (6 - n)
        assert out.accepted_mask[i].tolist() == [True] * n + [False] * (6 - n)
    assert out.num_emitted_tokens.tolist() == (out.num_accepted + 1).tolist()


BAD_INPUTS: list[tuple[Callable[[Batch], Batch], str]] = [
    (lambda b: (b[0], b[1].flip(0), b[2], b[3], b[4]), "non-decreasing"),
    (lambda b: (b[0], b[1] - 1, b[2], b[3], b[4]), "ends at"),
    (lambda b: (b[0] + 100, b[1], b[2], b[3], b[4]), r"must lie in \[0, 50\)"),
    (lambda b: (b[0].float(), b[1], b[2], b[3], b[4]), "draft_token_ids must be int32 or int64"),
    (lambda b: (b[0], b[1], b[2], b[3][:-1], b[4]), "target_probs must have shape"),
]


@pytest.mark.parametrize(("change", "message"), BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(change: Callable[[Batch], Batch], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rejection_sample(*change(random_batch(4, 2, 50, seed=0)))


def test_generator_count_must_match_the_batch() -> None:
    with pytest.raises(ValueError, match="generators for a batch of 4"):
        rejection_sample(*random_batch(4, 2, 50, seed=0), generators=[None])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_batch(backend: str) -> None:
    none = torch.zeros(0, dtype=torch.long)
    out = rejection_sample(none, none, None, torch.zeros(0, 9), none.bool(), backend=backend)
    assert out.output_token_ids.shape == (0, 1) and out.accepted_mask.shape == (0, 0)
