"""The paged-attention kernel against its torch reference, and the reference against dense SDPA.

Without CUDA the kernel runs in Triton's interpreter (see tests/kernels/__init__.py). The broad
sweep is slow there; set SPECDEC_SLOW_TESTS=1 to run it (on a GPU it always runs).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from specdec.kernels.paged_attention import paged_attention_reference, paged_attention_triton
from tests.kernels import compile_for_hopper

pytestmark = pytest.mark.cuda  # selected by make gpu-check
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IMPLEMENTATIONS = [paged_attention_triton, paged_attention_reference]
# Float32 math throughout; half-precision inputs round the probabilities and the output.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
slow = pytest.mark.skipif(  # compiled on a GPU, the sweep takes seconds: it always runs there
    os.environ.get("SPECDEC_SLOW_TESTS") != "1" and not torch.cuda.is_available(),
    reason="interpreted, the sweep is slow: SPECDEC_SLOW_TESTS=1 runs it",
)


@dataclass
class Batch:
    """Launcher arguments, and each sequence's dense K/V that the cache holds in pages."""

    args: tuple  # (query, cu_q_lens, seq_lens, block_tables, k_cache, v_cache)
    keys: list[torch.Tensor]  # [L_b, Hkv, D] per sequence, float32
    values: list[torch.Tensor]  # [L_b, Hkv, D] per sequence, float32


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """Random queries and contexts; blocks are handed out in shuffled order.

    Cache slots that hold no key of any sequence are NaN: reading one poisons the output.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (num_kv_heads, head_dim)
    keys = [torch.randn(n, *shape, generator=gen).to(dtype).float() for n in seq_lens]
    values = [torch.randn(n, *shape, generator=gen).to(dtype).float() for n in seq_lens]
    tables = _shuffled_block_tables(seq_lens, block_size, gen)
    num_blocks = max(itertools.chain(*tables)) + 3  # a few blocks nobody owns
    k_cache = torch.full((num_blocks, block_size, *shape), float("nan"))
    v_cache = torch.full((num_blocks, block_size, *shape), float("nan"))
    for table, k, v in zip(tables, keys, values):
        positions = torch.arange(k.shape[0])  # [L]
        blocks = torch.tensor(table, dtype=torch.long)[positions // block_size]  # [L]
        k_cache[blocks, positions % block_size] = k
        v_cache[blocks, positions % block_size] = v
    width = max(len(t) for t in tables) + 1  # one padding column at least
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query = 2 * torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen)  # peaked softmax
    cu_q_lens = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    args = (
        query.to(dtype),
        cu_q_lens,
        torch.tensor(seq_lens, dtype=torch.int32),
        block_tables,
        k_cache.to(dtype),
        v_cache.to(dtype),
    )
    return Batch(tuple(a.to(DEVICE) for a in args), keys, values)


def _shuffled_block_tables(
    seq_lens: list[int], block_size: int, gen: torch.Generator
) -> list[list[int]]:
    counts = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(counts) + 2, generator=gen).tolist()
    starts = [0, *itertools.accumulate(counts)]
    return [order[s : s + c] for s, c in zip(starts, counts)]


def dense_attention(
    query: torch.Tensor,  # [Q, Hq, D] the last Q positions of the context
    keys: torch.Tensor,  # [L, Hkv, D]
    values: torch.Tensor,  # [L, Hkv, D]
    scale: float | None,
) -> torch.Tensor:  # [Q, Hq, D] float32
    """Causal attention of the last Q positions through torch's SDPA with an explicit mask."""
    q_len, seq_len = query.shape[0], keys.shape[0]
    positions = torch.arange(seq_len - q_len, seq_len)  # [Q]
    mask = torch.arange(seq_len) <= positions[:, None]  # [Q, L]
    out = F.scaled_dot_product_attention(
        query.float().transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )  # [Hq, Q, D]
    return out.transpose(0, 1)


CASES = [  # (q_lens, seq_lens, Hq, Hkv, D, block_size)
    ([1, 3, 5, 2], [37, 70, 5, 16], 4, 2, 32, 16),  # partial blocks, a whole-context query
    ([1, 1, 1], [1, 33, 64], 2, 2, 16, 8),  # decodes; one key, block and tile boundaries
    ([4, 2, 5, 1], [9, 41, 69, 8], 4, 1, 16, 8),  # all query heads on one KV head
    ([17, 1], [50, 20], 4, 1, 16, 16),  # 68 rows: more than one row tile
]
SWEEP = [
    (q_lens, seq_lens, hq, hkv, d, bs)
    for (q_lens, seq_lens), (hq, hkv), d, bs in itertools.product(
        [([1, 2, 3, 4, 5], [5, 17, 31, 48, 70]), ([1] * 6, [1, 2, 15, 16, 17, 64])],
        [(8, 2), (4, 4), (2, 1)],
        [16, 64],
        [8, 16, 32],
    )
]


def assert_kernel_matches_reference(batch: Batch, scale: float | None = None) -> None:
    out = paged_attention_triton(*batch.args, scale=scale)
    expected = paged_attention_reference(*batch.args, scale=scale)
    tol = TOLERANCE[out.dtype]
    assert out.dtype == expected.dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("q_lens", "seq_lens", "hq", "hkv", "d", "bs"), CASES)
def test_kernel_matches_reference(q_lens, seq_lens, hq: int, hkv: int, d: int, bs: int) -> None:
    assert_kernel_matches_reference(make_batch(q_lens, seq_lens, hq, hkv, d, bs))


@slow
@pytest.mark.parametrize(("q_lens", "seq_lens", "hq", "hkv", "d", "bs"), SWEEP)
def test_kernel_matches_reference_sweep(
    q_lens, seq_lens, hq: int, hkv: int, d: int, bs: int
) -> None:
    assert_kernel_matches_reference(make_batch(q_lens, seq_lens, hq, hkv, d, bs, seed=d + bs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_reference_low_precision(dtype: torch.dtype) -> None:
    assert_kernel_matches_reference(make_batch(*CASES[0], dtype=dtype))


def test_kernel_takes_the_given_scale() -> None:
    assert_kernel_matches_reference(make_batch(*CASES[2], seed=1), scale=0.7)


def test_max_q_len_is_only_a_tile_hint() -> None:
    batch = make_batch(*CASES[3], seed=2)
    hinted = paged_attention_triton(*batch.args, max_q_len=1)  # one 16-row tile, five passes
    torch.testing.assert_close(hinted, paged_attention_triton(*batch.args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("q_lens", "seq_lens", "hq", "hkv", "d", "bs"), CASES)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_reference_matches_dense_attention(
    q_lens, seq_lens, hq: int, hkv: int, d: int, bs: int, scale: float | None
) -> None:
    batch = make_batch(q_lens, seq_lens, hq, hkv, d, bs)
    query, cu_q_lens = batch.args[0].cpu(), batch.args[1].tolist()
    out = paged_attention_reference(*batch.args, scale=scale).cpu()
    for b, (keys, values) in enumerate(zip(batch.keys, batch.values)):
        rows = slice(cu_q_lens[b], cu_q_lens[b + 1])
        expected = dense_attention(query[rows], keys, values, scale)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_empty_batch_gives_empty_output(impl) -> None:
    query, cu_q_lens, seq_lens, block_tables, k_cache, v_cache = make_batch([1], [3]).args
    args = (query[:0], cu_q_lens[:1], seq_lens[:0], block_tables[:0], k_cache, v_cache)
    assert impl(*args).shape == (0, *query.shape[1:])


def _broken(args: tuple, index: int, value: object) -> tuple:
    return args[:index] + (value,) + args[index + 1 :]


BAD_INPUTS = [  # (argument index, replacement builder, message)
    (0, lambda a: a[0].double(), "query must have dtype"),
    (0, lambda a: a[0].flatten(1), "query must be 3-D"),
    (0, lambda a: a[0][:, :3].contiguous(), r"Hq \(3\) must be a multiple of Hkv \(2\)"),
    (0, lambda a: a[0].transpose(0, 1).contiguous().transpose(0, 1), "query must be contiguous"),
    (1, lambda a: a[1].long(), "cu_q_lens must have dtype"),
    (1, lambda a: a[1][:-1].contiguous(), "cu_q_lens must have shape"),
    (2, lambda a: a[2][1:].contiguous(), r"cu_q_lens must have shape \(2,\), got \(3,\)"),
    (2, lambda a: a[2][:, None], "seq_lens must be 1-D"),
    (2, lambda a: a[2].float(), "seq_lens must have dtype"),
    (3, lambda a: a[3][1:].contiguous(), "block_tables must have shape"),
    (3, lambda a: a[3].flatten(), "block_tables must be 2-D"),
    (4, lambda a: a[4].half(), "k_cache must have dtype"),
    (4, lambda a: a[4][..., :16].contiguous(), "k_cache must have shape"),
    (5, lambda a: a[5][:, :8].contiguous(), "v_cache must have shape"),
    (5, lambda a: a[5].bfloat16(), "v_cache must have dtype"),
]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(("index", "replace", "message"), BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(impl, index: int, replace, message: str) -> None:
    args = make_batch([1, 2], [5, 20]).args
    with pytest.raises(ValueError, match=message):
        impl(*_broken(args, index, replace(args)))


def test_kernel_rejects_head_dim_not_a_power_of_two() -> None:
    batch = make_batch([1, 2], [5, 20], head_dim=24)
    with pytest.raises(ValueError, match="head_dim must be a power of two >= 16"):
        paged_attention_triton(*batch.args)


def test_reference_rejects_lengths_that_do_not_fit() -> None:
    args = make_batch([1, 2], [5, 20]).args
    with pytest.raises(ValueError, match="cu_q_lens ends at 4"):
        paged_attention_reference(*_broken(args, 1, args[1] + torch.tensor([0, 0, 1]).to(args[1])))
    with pytest.raises(ValueError, match="sequence 1: q_len 2 and seq_len 99 do not fit"):
        paged_attention_reference(*_broken(args, 2, args[2] + torch.tensor([0, 79]).to(args[2])))


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specdec.kernels.paged_attention import _paged_attention_kernel as kernel

for dtype, head_dim, block_m in [("fp32", 64, 16), ("bf16", 128, 64), ("fp16", 128, 16)]:
    types = ["*" + dtype] * 2 + ["*i32"] * 3 + ["*" + dtype] * 2 + ["fp32"] + ["i32"] * 3
    types += ["constexpr"] * 5
    constexprs = {"GROUP": 4, "HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": 32, "UPCAST": False}
    source = ASTSource(kernel, dict(zip(kernel.arg_names, types)), constexprs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(dtype, "mma" in ptx)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the other kernel tests compile it")
def test_kernel_compiles_for_hopper() -> None:
    # Half-precision tiles go through tensor-core MMAs; float32 stays exact (no TF32).
    printed = compile_for_hopper(COMPILE_FOR_HOPPER).split()
    assert printed == ["fp32", "False", "bf16", "True", "fp16", "True"]
