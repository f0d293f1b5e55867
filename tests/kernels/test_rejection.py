"""The fused rejection-sampling kernel against its torch reference, and both on edge cases.

Without CUDA the kernel runs in Triton's interpreter (see tests/kernels/__init__.py). The broad
sweep is slow there; set SPECDEC_SLOW_TESTS=1 to run it (on a GPU it always runs).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from specdec.kernels.rejection import rejection_sample_triton, verify_row_tokens_triton
from specdec.kernels.rejection_reference import (
    rejection_sample_reference,
    verify_row_tokens_reference,
)
from tests.kernels import compile_for_hopper

pytestmark = pytest.mark.cuda  # selected by make gpu-check
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IMPLEMENTATIONS = [rejection_sample_triton, rejection_sample_reference]
slow = pytest.mark.skipif(  # compiled on a GPU, the sweep takes seconds: it always runs there
    os.environ.get("SPECDEC_SLOW_TESTS") != "1" and not torch.cuda.is_available(),
    reason="interpreted, the sweep is slow: SPECDEC_SLOW_TESTS=1 runs it",
)


def make_batch(
    batch: int,
    max_k: int,
    vocab: int,
    with_draft_probs: bool,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple:
    """Random launcher arguments: mixed greedy and random rows, k_i in [0, max_k], many accepts.

    Greedy rows hold raw logits, all negative: only their argmax may matter.
    """
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(0, max_k + 1, (batch,), generator=gen)
    k[::2] = max_k  # half the rows propose the full k
    is_greedy = torch.rand(batch, generator=gen) < 0.4  # [B]
    cu = k.cumsum(0)  # [B]
    num_drafts = int(cu[-1])
    target_rows = torch.arange(num_drafts) + torch.repeat_interleave(torch.arange(batch), k)  # [T]
    logits = torch.randn(num_drafts + batch, vocab, generator=gen) * 4  # [T + B, V]
    target = _with_zeros(torch.softmax(logits, dim=-1), gen)  # [T + B, V]
    greedy_rows = torch.repeat_interleave(is_greedy, k + 1).unsqueeze(1)  # [T + B, 1]
    target = torch.where(greedy_rows, logits - 30, target)
    draft = _with_zeros(
        torch.softmax(
            logits[target_rows] + 0.3 * torch.randn(num_drafts, vocab, generator=gen), dim=-1
        ),
        gen,
    )  # [T, V] close to the target, so chains of accepts happen
    sampled = torch.multinomial(draft, 1, generator=gen).squeeze(1) if num_drafts else cu[:0]
    argmax = target[target_rows].argmax(dim=-1)  # [T]
    tokens = torch.where(torch.rand(num_drafts, generator=gen) < 0.7, argmax, sampled)  # [T]
    args = (
        tokens,
        cu,
        draft.to(dtype) if with_draft_probs else None,
        target.to(dtype),
        is_greedy,
        torch.rand(num_drafts, generator=gen, dtype=torch.float64),
        torch.empty(batch, vocab, dtype=torch.float64).exponential_(generator=gen),
    )
    return tuple(a.to(DEVICE) if a is not None else None for a in args) + (max_k,)


def _with_zeros(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:  # [N, V]
    """Zero about 5% of the entries (never a whole row) and renormalise."""
    keep = (torch.rand(probs.shape, generator=gen) > 0.05) | (probs == probs.amax(-1, keepdim=True))
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)


def assert_kernel_matches_reference(args: tuple) -> None:
    tokens, num_accepted = rejection_sample_triton(*args)
    ref_tokens, ref_num_accepted = rejection_sample_reference(*args)
    assert torch.equal(num_accepted, ref_num_accepted)
    assert torch.equal(tokens, ref_tokens)


DEFAULT_CASES = [  # (B, k, V, with draft probs): every value of each axis at least once
    (1, 16, 49152, True),
    (7, 5, 49152, False),
    (1, 0, 49152, False),
    (64, 0, 50, True),
    (64, 1, 50, False),
    (64, 5, 50, True),
    (64, 16, 50, True),
    (64, 16, 50, False),
    (7, 1, 50, True),
]
SWEEP = [
    case
    for case in itertools.product([1, 7, 64], [0, 1, 5, 16], [50, 49152], [True, False])
    if case not in DEFAULT_CASES
]


@pytest.mark.parametrize(("batch", "max_k", "vocab", "with_draft_probs"), DEFAULT_CASES)
def test_kernel_matches_reference(
    batch: int, max_k: int, vocab: int, with_draft_probs: bool
) -> None:
    assert_kernel_matches_reference(make_batch(batch, max_k, vocab, with_draft_probs))


@slow
@pytest.mark.parametrize(("batch", "max_k", "vocab", "with_draft_probs"), SWEEP)
def test_kernel_matches_reference_sweep(
    batch: int, max_k: int, vocab: int, with_draft_probs: bool
) -> None:
    assert_kernel_matches_reference(make_batch(batch, max_k, vocab, with_draft_probs, seed=batch))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_reference_low_precision(dtype: torch.dtype) -> None:
    assert_kernel_matches_reference(make_batch(7, 5, 50, True, dtype=dtype))


def test_kernel_matches_reference_many_seeds() -> None:
    for seed in range(5):
        assert_kernel_matches_reference(make_batch(16, 4, 37, seed % 2 == 0, seed=seed))


def one_sequence(
    drafts: list[int],
    target: torch.Tensor,  # [k + 1, V]
    draft_probs: torch.Tensor | None = None,  # [k, V]
    greedy: bool = False,
    u: float = 0.5,
    seed: int = 0,
) -> tuple:
    """Launcher arguments for a batch holding one sequence."""
    noise = torch.empty(1, target.shape[1], dtype=torch.float64)
    noise.exponential_(generator=torch.Generator().manual_seed(seed))
    args = (
        torch.tensor(drafts, dtype=torch.long),
        torch.tensor([len(drafts)]),
        draft_probs,
        target,
        torch.tensor([greedy]),
        torch.full((len(drafts),), u, dtype=torch.float64),
        noise,
    )
    return tuple(a.to(DEVICE) if a is not None else None for a in args) + (len(drafts),)


def race(probs: torch.Tensor, noise: torch.Tensor) -> int:  # [V], [1, V] -> argmax p / E
    return int((probs.double().to(DEVICE) / noise[0]).argmax())


def normalised(rows: list[list[float]]) -> torch.Tensor:  # [N, V]
    probs = torch.tensor(rows, dtype=torch.float32)
    return (probs / probs.sum(dim=-1, keepdim=True)).to(DEVICE)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_draft_with_zero_target_probability_is_rejected(impl, with_draft_probs: bool) -> None:
    target = normalised([[0, 1, 1, 1, 1, 1, 1], [1] * 7])  # p(d_0 = 0) = 0
    draft_probs = normalised([[1, 0, 0, 0, 0, 0, 0]]) if with_draft_probs else None
    args = one_sequence([0], target, draft_probs, u=0.0)  # u = 0 is the most accepting uniform
    tokens, num_accepted = impl(*args)
    assert num_accepted.tolist() == [0]
    assert tokens[0, 0].item() != 0 and tokens[0, 1].item() == -1


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_draft_with_zero_draft_probability_is_accepted(impl) -> None:
    target = normalised([[1, 1, 1, 1, 1], [1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])
    draft_probs = normalised([[0, 1, 1, 1, 1], [1, 1, 0, 1, 1]])  # q(d_j) = 0 < p(d_j)
    args = one_sequence([0, 2], target, draft_probs, u=1.0 - 1e-12)
    tokens, num_accepted = impl(*args)
    assert num_accepted.tolist() == [2]
    assert tokens[0].tolist() == [0, 2, race(target[2], args[6])]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_equal_distributions_accept_every_draft(impl) -> None:
    target = make_batch(1, 0, 23, False)[3].repeat(6, 1).cpu()  # [6, V], same p at every row
    drafts = torch.multinomial(target[0], 5, replacement=True).tolist()
    args = one_sequence(drafts, target.to(DEVICE), target[:5].to(DEVICE), u=1.0 - 1e-12)
    tokens, num_accepted = impl(*args)
    assert num_accepted.tolist() == [5]
    assert tokens[0].tolist() == drafts + [race(target[5], args[6])]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_recovered_token_comes_from_the_residual(impl, with_draft_probs: bool) -> None:
    # p = (.2, .8, 0, 0, 0); d_0 = 0 with q(0) = 1 is accepted with probability .2, so u = .5
    # rejects it and max(0, p - q) = (0, .8, 0, 0, 0) leaves only token 1, whatever the noise.
    target = normalised([[1, 4, 0, 0, 0], [1, 1, 1, 1, 1]])
    draft_probs = normalised([[1, 0, 0, 0, 0]]) if with_draft_probs else None
    for seed in range(3):
        tokens, num_accepted = impl(*one_sequence([0], target, draft_probs, u=0.5, seed=seed))
        assert num_accepted.tolist() == [0] and tokens[0].tolist() == [1, -1]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_all_zero_residual_falls_back_to_the_target(impl) -> None:
    # p == q and p(d) = q(d) = 0: the draft is rejected and max(0, p - q) is zero everywhere.
    target = normalised([[0, 3, 1, 2, 5, 1, 1], [1] * 7])
    tokens, num_accepted = impl(*(args := one_sequence([0], target, target[:1], u=0.0)))
    assert num_accepted.tolist() == [0]
    assert tokens[0].tolist() == [race(target[0], args[6]), -1]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_sequences_without_drafts_emit_a_bonus_token(impl) -> None:
    tokens_, cu, _, target, greedy, uniforms, noise, _ = make_batch(6, 0, 13, False)
    tokens, num_accepted = impl(tokens_, cu, None, target, greedy, uniforms, noise, 0)
    expected = [
        int(target[i].argmax()) if greedy[i] else race(target[i], noise[i : i + 1])
        for i in range(6)
    ]
    assert num_accepted.tolist() == [0] * 6 and tokens[:, 0].tolist() == expected


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_greedy_rows_emit_the_target_argmax_chain(impl) -> None:
    vocab = 10007  # prime and larger than one block of the kernel: a partial last block
    target = torch.full((4, vocab), 1.0)
    target[0, 7], target[1, vocab - 1], target[2, 5], target[2, 9000] = 9.0, 9.0, 9.0, 9.0
    target = (target / target.sum(dim=-1, keepdim=True)).to(DEVICE)  # argmax 7, V - 1, 5 (tie)
    for drafts, expected, accepted in [
        ([7, vocab - 1, 5], [7, vocab - 1, 5, 0], 3),  # all match: bonus argmax (tie at 0)
        ([7, 3, 5], [7, vocab - 1, -1, -1], 1),  # mismatch at 1: emit the argmax there
        ([9000, vocab - 1, 5], [7, -1, -1, -1], 0),
        ([7, vocab - 1, 9000], [7, vocab - 1, 5, -1], 2),  # ties break to the first index
    ]:
        tokens, num_accepted = impl(*one_sequence(drafts, target, greedy=True, u=0.0))
        assert num_accepted.tolist() == [accepted] and tokens[0].tolist() == expected


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_greedy_rows_may_hold_raw_logits(impl) -> None:
    logits = torch.tensor([[-9.0, -3.0, -5.0], [-7.0, -8.0, -1.0], [float("-inf"), -2.0, -4.0]])
    tokens, num_accepted = impl(*one_sequence([1, 0], logits.to(DEVICE), greedy=True))
    assert num_accepted.tolist() == [1] and tokens[0].tolist() == [1, 2, -1]
    tokens, num_accepted = impl(*one_sequence([1, 2], logits.to(DEVICE), greedy=True))
    assert num_accepted.tolist() == [2] and tokens[0].tolist() == [1, 2, 1]


def _broken(args: tuple, index: int, value: object) -> tuple:
    return args[:index] + (value,) + args[index + 1 :]


BAD_INPUTS = [  # (argument index, replacement builder, message)
    (0, lambda a: a[0].int(), "draft_token_ids must have dtype"),
    (1, lambda a: a[1].int(), "cu_num_draft_tokens must have dtype"),
    (2, lambda a: a[2][:, :-1].contiguous(), "draft_probs must have shape"),
    (3, lambda a: a[3].double(), "target_probs must have dtype"),
    (3, lambda a: a[3][1:].contiguous(), "target_probs must have shape"),
    (3, lambda a: a[3].t().contiguous().t(), "target_probs must be contiguous"),
    (3, lambda a: a[3].flatten(), "target_probs must be 2-D"),
    (4, lambda a: a[4].long(), "is_greedy must have dtype"),
    (5, lambda a: a[5].float(), "accept_uniforms must have dtype"),
    (6, lambda a: a[6][:, :-1].contiguous(), "race_exponentials must have shape"),
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(("index", "replace", "message"), BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(impl, index: int, replace, message: str) -> None:
    args = make_batch(3, 2, 11, True)
    with pytest.raises(ValueError, match=message):
        impl(*_broken(args, index, replace(args)))


def row_token_batch(batch: int, max_k: int, vocab: int, seed: int = 0) -> tuple:
    """Row-token launcher arguments: mixed greedy (raw logits) and random (probabilities) rows,
    drafts that equal their row's token 80% of the time, so accepted chains and rejections mix."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(0, max_k + 1, (batch,), generator=gen)
    k[::2] = max_k
    is_greedy = torch.rand(batch, generator=gen) < 0.4  # [B]
    num_drafts = int(k.sum())
    logits = torch.randn(num_drafts + batch, vocab, generator=gen) * 3  # [T + B, V]
    greedy_rows = torch.repeat_interleave(is_greedy, k + 1).unsqueeze(1)  # [T + B, 1]
    rows = torch.where(greedy_rows, logits, _with_zeros(torch.softmax(logits, -1), gen))
    noise = torch.empty(num_drafts + batch, vocab).exponential_(generator=gen)  # [T + B, V]
    row_token = torch.where(greedy_rows, rows, rows / noise).argmax(dim=1)  # [T + B]
    draft_rows = torch.arange(num_drafts) + torch.repeat_interleave(torch.arange(batch), k)
    other = torch.randint(0, vocab, (num_drafts,), generator=gen)
    drafts = torch.where(torch.rand(num_drafts, generator=gen) < 0.8, row_token[draft_rows], other)
    args = (drafts, k.cumsum(0), rows.contiguous(), is_greedy, noise)
    return tuple(a.to(DEVICE) for a in args) + (max_k,)


@pytest.mark.parametrize(
    ("batch", "max_k", "vocab"), [(1, 8, 49152), (9, 5, 50), (64, 8, 300), (5, 0, 300)]
)
def test_row_token_kernel_matches_reference(batch: int, max_k: int, vocab: int) -> None:
    args = row_token_batch(batch, max_k, vocab)
    tokens, num_accepted = verify_row_tokens_triton(*args)
    ref_tokens, ref_num_accepted = verify_row_tokens_reference(*args)
    assert torch.equal(num_accepted, ref_num_accepted)
    assert torch.equal(tokens, ref_tokens)
    if max_k:  # the batch exercised accepted chains and rejections both
        k = torch.diff(args[1], prepend=args[1].new_zeros(1))
        assert 0 < int(num_accepted.sum()) < int(k.sum())


def test_row_tokens_are_plain_decoding_tokens() -> None:
    """Each emitted token is its row's token: the argmax of a greedy row's logits, the race
    winner of a random row's probabilities over that row's own noise."""
    rows = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [-3.0, -1.0, -2.0], [-1.0, -4.0, 0.0]])
    noise = torch.tensor([[1.0, 1.0, 1.0], [9.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    greedy = torch.tensor([False, True])
    args = (torch.tensor([1, 1]), torch.tensor([1, 2]), rows, greedy, noise, 1)
    for impl in (verify_row_tokens_triton, verify_row_tokens_reference):
        tokens, num_accepted = impl(*(a.to(DEVICE) if torch.is_tensor(a) else a for a in args))
        # random row: draft 1 accepted (0.6 wins), then row 1's race picks 2 (0.3 > 0.5 / 9)
        # greedy row: draft 1 at row 2 accepted (argmax 1), then row 3's argmax 2
        assert tokens.tolist() == [[1, 2], [1, 2]]
        assert num_accepted.tolist() == [1, 1]


@pytest.mark.parametrize("impl", [verify_row_tokens_triton, verify_row_tokens_reference])
def test_row_token_inputs_are_checked(impl) -> None:
    args = row_token_batch(3, 2, 11)
    with pytest.raises(ValueError, match="row_noise must have dtype"):
        impl(*_broken(args, 4, args[4].double()))
    with pytest.raises(ValueError, match="row_noise must have shape"):
        impl(*_broken(args, 4, args[4][1:].contiguous()))
    with pytest.raises(ValueError, match="target_rows must be 2-D"):
        impl(*_broken(args, 2, args[2].flatten()))


COMPILE_FOR_HOPPER = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specdec.kernels.rejection import _rejection_sample_kernel as kernel

# (target dtype, draft probs, row-token mode): the row-token mode's noise is float32
for probs, has_draft_probs, row_tokens in [
    ("fp32", True, False), ("bf16", False, False), ("fp32", False, True)
]:
    noise = "*fp32" if row_tokens else "*fp64"
    pointers = ["*i64"] * 4 + ["*" + probs] * 2 + ["*i1", noise, noise]
    types = pointers + ["i32", "i32", "constexpr", "constexpr", "constexpr"]
    constexprs = {"HAS_DRAFT_PROBS": has_draft_probs, "BLOCK": 2048, "ROW_TOKENS": row_tokens}
    source = ASTSource(kernel, dict(zip(kernel.arg_names, types)), constexprs)
    options = {"num_warps": 8, "enable_fp_fusion": False}
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    print(sorted(set(re.findall(r"div\\.[a-z0-9.]+", ptx))))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the other kernel tests compile it")
def test_kernel_compiles_for_hopper() -> None:
    # Divisions are correctly rounded, as torch's are, so the kernel matches the reference.
    divisions = compile_for_hopper(COMPILE_FOR_HOPPER).split()
    assert divisions == ["['div.rn.f64']"] * 2 + ["['div.rn.f32']"]
