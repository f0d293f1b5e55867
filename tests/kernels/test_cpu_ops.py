"""The fused CPU kernels against their torch references, row by row, and their fallback."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

from specdec.attention import AttentionMetadata, QueryGroup, paged_attention
from specdec.kernels import cpu_ops
from specdec.models.llama import LlamaForCausalLM
from specdec.runner import ModelRunner, QueryChunk
from tests.tiny import tiny_model

switched_off = os.environ.get("SPECDEC_CPU_KERNELS", "1") == "0"
needs_kernels = pytest.mark.skipif(switched_off, reason="SPECDEC_CPU_KERNELS=0")
SHAPES = [(1, 576), (7, 64), (100, 40)]  # 40: a row that is no whole number of 16-lane blocks


def ext():  # noqa: ANN201
    module = cpu_ops.extension()
    assert module is not None, "the fused CPU kernels did not build"
    return module


def same(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Within one ulp of the reference: its sum and exp run in another order (see cpu_ops)."""
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-22
    torch.testing.assert_close(a, b, rtol=ulp, atol=ulp)


def by_rows(fn, *tensors: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """``fn`` applied to each row alone, concatenated."""
    return torch.cat([fn(*(t[i : i + 1] for t in tensors)) for i in range(tensors[0].shape[0])])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    x = (3 * torch.randn(shape)).to(dtype)
    w = torch.randn(shape[1]).to(dtype)
    out = ext().rms_norm(x, w, 1e-5)
    same(out, cpu_ops.rms_norm_reference(x, w, 1e-5), dtype)
    assert torch.equal(out, by_rows(lambda r: ext().rms_norm(r, w, 1e-5), x))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm_updates_the_residual_in_place(
    dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    torch.manual_seed(1)
    residual, x = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    w = torch.randn(shape[1]).to(dtype)
    expected_residual = residual.clone()
    expected = cpu_ops.add_rms_norm_reference(expected_residual, x, w, 1e-6)
    stream = residual.clone()
    out = ext().add_rms_norm_(stream, x, w, 1e-6)
    assert torch.equal(stream, expected_residual)  # one rounding of the sum, as torch's add
    same(out, expected, dtype)
    rows = by_rows(lambda r, xr: ext().add_rms_norm_(r.clone(), xr, w, 1e-6), residual, x)
    assert torch.equal(out, rows)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,size", [(1, 1536), (9, 64), (33, 24)])
def test_silu_mul(dtype: torch.dtype, rows: int, size: int) -> None:
    torch.manual_seed(2)
    gate_up = (4 * torch.randn(rows, 2 * size)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow and underflow
    out = ext().silu_mul(gate_up)
    same(out, cpu_ops.silu_mul_reference(gate_up), dtype)
    assert torch.equal(out, by_rows(ext().silu_mul, gate_up))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16)])
def test_rope_rotates_q_and_k_in_place(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(3)
    rows, rotated_heads = 11, heads + kv_heads
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.rand(rows, head_dim // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    expected = qkv.clone()
    cpu_ops.rope_reference(expected, cos, sin, rotated_heads, head_dim)
    out = qkv.clone()
    ext().rope_(out, cos, sin, rotated_heads, head_dim)
    assert not torch.equal(out, qkv)
    assert torch.equal(out[:, rotated_heads * head_dim :], qkv[:, rotated_heads * head_dim :])
    # the rotation's two products and sum round exactly as torch's three ops: equal in both dtypes
    assert torch.equal(out, expected)


@needs_kernels
def test_kernels_reject_bad_arguments() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="one entry per feature"):
        ext().rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ext().silu_mul(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="heads do not fit"):
        ext().rope_(x, torch.ones(2, 4), torch.ones(2, 4), 3, 4)


def test_ops_fall_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other dtypes and devices, and a machine without the kernels, run the references."""
    x = torch.randn(3, 16, dtype=torch.float64)
    w = torch.randn(16, dtype=torch.float64)
    assert torch.equal(cpu_ops.rms_norm(x, w, 1e-5), cpu_ops.rms_norm_reference(x, w, 1e-5))
    monkeypatch.setattr(cpu_ops, "extension", lambda: None)
    x32, w32 = x.float(), w.float()
    assert torch.equal(cpu_ops.rms_norm(x32, w32, 1e-5), cpu_ops.rms_norm_reference(x32, w32, 1e-5))
    gate_up = torch.randn(2, 8)
    assert torch.equal(cpu_ops.silu_mul(gate_up), cpu_ops.silu_mul_reference(gate_up))


def test_a_failed_build_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise OSError("no C++ compiler")

    monkeypatch.setattr(cpu_ops, "_build", broken)
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "1")
    cpu_ops.extension.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
            assert cpu_ops.extension() is None
        monkeypatch.setenv("SPECDEC_CPU_KERNELS", "0")
        cpu_ops.extension.cache_clear()
        assert cpu_ops.extension() is None and not cpu_ops.enabled()
    finally:
        cpu_ops.extension.cache_clear()  # the next test builds (loads) the real one again


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_logits_match_the_torch_path(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny model's prefill and decode logits with the kernels and with torch's ops."""
    hf = tiny_model(arch)
    prompt = torch.randint(0, 256, (21,)).tolist()
    fused = tiny_steps(hf, prompt)()
    monkeypatch.setattr(cpu_ops, "extension", lambda: None)  # a model of plain nn.Linears
    torch.testing.assert_close(fused, tiny_steps(hf, prompt)(), rtol=1e-5, atol=1e-5)
    expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(fused, expected, rtol=1e-4, atol=1e-4)


def tiny_steps(hf, prompt: list[int]):  # noqa: ANN001, ANN201
    """A function running ``hf``'s weights on our runner: a 20-token prefill of ``prompt``, then
    one step over the rest of it (a decode, or a verification), returning every logit row."""
    model = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), 256)
    runner = ModelRunner(model, 32, 4, torch.float32)
    table = list(range(8))

    def run() -> torch.Tensor:
        prefill = runner.forward([QueryChunk(prompt[:20], 0, table, 20)])[0]
        rest = runner.forward([QueryChunk(prompt[20:], 20, table, len(prompt) - 20)])[0]
        return torch.cat([prefill, rest])

    return run


def paged_step(parts, caches, heads):  # noqa: ANN001, ANN201
    """``paged_attention`` over ``parts``: (q, k, v, table, start, end) per sequence."""
    q = torch.cat([p[0][p[4] : p[5]] for p in parts])
    k = torch.cat([p[1][p[4] : p[5]] for p in parts])
    v = torch.cat([p[2][p[4] : p[5]] for p in parts])
    slots = [t[i // 4] * 4 + i % 4 for _, _, _, t, a, b in parts for i in range(a, b)]
    meta = AttentionMetadata.build(
        [b - a for *_, a, b in parts], [b for *_, b in parts], [p[3] for p in parts],
        torch.tensor(slots), 4,
    )  # fmt: skip
    return paged_attention(q, k, v, *caches, meta, 0.125)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 16), (4, 2, 128), (2, 1, 40)])
def test_cached_attention_matches_sdpa_and_is_row_invariant(
    dtype: torch.dtype, heads: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Head dims of one to eight 16-lane pieces (AVX-512 path), and 40 (the portable path)."""
    torch.manual_seed(4)
    num_heads, num_kv_heads, head_dim = heads
    seqs = []
    for i, n in enumerate((40, 13, 70)):
        q, k, v = (torch.randn(n, h, head_dim).to(dtype) for h in heads[:2] + heads[1:2])
        seqs.append((q, k, v, list(range(20 * i, 20 * i + 18))))
    caches = [torch.zeros(64, 4, num_kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    for q, k, v, table in seqs:  # prompts computed whole (torch's SDPA): K/V into the cache
        paged_step([(q, k, v, table, 0, len(q) - 9)], caches, heads)
    a, b, c = seqs
    steps = {  # decodes, verifications and a later prompt chunk beside them
        "decodes": [(*a, 31, 32), (*b, 4, 5), (*c, 61, 62)],
        "verify beside decode": [(*a, 31, 40), (*b, 4, 5)],
        "chunk beside verify": [(*c, 20, 61), (*a, 31, 36)],
    }
    for name, parts in steps.items():
        fused = paged_step(parts, caches, heads)
        with monkeypatch.context() as m:
            m.setattr(cpu_ops, "extension_for", lambda t: None)
            reference = paged_step(parts, caches, heads)
        tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(fused, reference, rtol=tol, atol=tol, msg=name)
    # a query's output is the same alone and among others (sequence a at position 31)
    alone = paged_step([(*a, 31, 32)], caches, heads)
    assert torch.equal(alone, paged_step(steps["decodes"], caches, heads)[:1])
    assert torch.equal(alone, paged_step(steps["verify beside decode"], caches, heads)[:1])


@needs_kernels
@pytest.mark.parametrize("block", [16, 32, 8, 4])
def test_bf16_attention_of_a_long_prompt_is_the_same_in_every_step_shape(block: int) -> None:
    """A 700-token sequence's rows (bf16, the AMX tiles where the CPU has them): the whole prompt
    as one chunk, chunks of other lengths, verifications and lone decodes give every position the
    same bits, close to torch's attention. Block tables out of order: with blocks of 8 or 4,
    16 keys are rarely in consecutive slots (copied), with 16 or 32 always (read in place)."""
    _check_long_prompt(ext(), block)


@pytest.mark.skipif(os.environ.get("SPECDEC_SLOW_TESTS") != "1", reason="SPECDEC_SLOW_TESTS=1")
@needs_kernels
def test_bf16_attention_without_amx_is_the_same_in_every_step_shape() -> None:
    """The vdpbf16ps kernel, what CPUs with AVX512-BF16 but no AMX run, compiled here."""
    kernels = cpu_ops._build(
        ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"), "specdec_cpu_ops_no_amx"
    )
    for block in (16, 4):
        _check_long_prompt(kernels, block)


def _check_long_prompt(kernels, block: int) -> None:  # noqa: ANN001
    torch.manual_seed(6)
    heads, kv_heads, head_dim, n = 9, 3, 64, 700
    blocks = -(-n // block)
    table = torch.randperm(blocks + 5)[:blocks].tolist()
    k_cache, v_cache = (
        torch.randn(blocks + 5, block, kv_heads, head_dim).mul(2.0).to(torch.bfloat16) for _ in "kv"
    )
    q = torch.randn(n, heads, head_dim).mul(2.0).to(torch.bfloat16)

    def attend(first: int, last: int) -> torch.Tensor:
        """The queries at positions first .. last - 1, as one chunk whose keys end at ``last``."""
        group = QueryGroup.build([last - first], [last], [table], [0], block, invariant=True)
        return kernels.cached_attention(q[first:last], k_cache, v_cache, group.query_index,
                                        group.key_slots, group.query_lens, group.context_lens,
                                        0.125)[0]  # fmt: skip

    whole = attend(0, n)
    for first, last in [(0, 37), (37, 300), (300, 301), (301, 310), (310, 700), (650, 659)]:
        assert torch.equal(attend(first, last), whole[first:last]), (first, last)
    for position in [0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 255, 256, 511, 699]:
        assert torch.equal(attend(position, position + 1)[0], whole[position]), position
    keys = k_cache[table].flatten(0, 1)[:n].transpose(0, 1).float()  # [Hkv, n, D]
    values = v_cache[table].flatten(0, 1)[:n].transpose(0, 1).float()
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys, values, is_causal=True, scale=0.125, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(whole.float(), reference, rtol=2e-2, atol=2e-2)


@needs_kernels
def test_cached_attention_rejects_bad_indices() -> None:
    q = torch.randn(2, 4, 16)
    cache = torch.zeros(8, 4, 2, 16)
    index, slots = torch.tensor([[0, 1]]), torch.tensor([[0, 1, 2]])
    ok = ext().cached_attention(q, cache, cache, index, slots, torch.tensor([2]),
                                torch.tensor([3]), 0.25)  # fmt: skip
    assert ok.shape == (1, 2, 4, 16)
    with pytest.raises(RuntimeError, match="bad key slot"):
        ext().cached_attention(q, cache, cache, index, torch.tensor([[0, 1, 99]]),
                               torch.tensor([2]), torch.tensor([3]), 0.25)  # fmt: skip
    with pytest.raises(RuntimeError, match="bad query or context lengths"):
        ext().cached_attention(q, cache, cache, index, slots, torch.tensor([2]),
                               torch.tensor([1]), 0.25)  # fmt: skip
    with pytest.raises(RuntimeError, match="outside the cache"):
        k = torch.randn(1, 2, 16)
        ext().write_kv_(k, k, cache, cache.clone(), torch.tensor([32]))


def test_builds_compile_copies_so_two_installs_share_one_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """ninja records each source's path: compiling the package's own files would make two
    installs of the same code (two environments, a clone) rebuild after each other. The build
    compiles copies kept in its own directory, written once, so their times never change."""
    from torch.utils import cpp_extension

    calls: list[dict] = []
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    cpu_ops._build(name="specdec_cpu_ops_probe")
    first = {p: os.stat(p).st_mtime_ns for p in calls[0]["sources"]}
    cpu_ops._build(name="specdec_cpu_ops_probe")
    assert calls[1]["sources"] == calls[0]["sources"]
    assert {p: os.stat(p).st_mtime_ns for p in calls[1]["sources"]} == first
    for copy, source in zip(calls[0]["sources"], cpu_ops.SOURCES, strict=True):
        assert copy.startswith(calls[0]["build_directory"])
        assert pathlib.Path(copy).read_text() == source.read_text()
    header = pathlib.Path(calls[0]["build_directory"]) / "src" / "cpu_simd.h"
    assert header.read_text() == cpu_ops.HEADER.read_text()
