"""The kernels' other builds (``-mno-avx512f``: what a CPU with AVX2 alone runs; scalar: neither)
against the native one. Slow: each build compiles the extension (``SPECDEC_SLOW_TESTS=1``)."""

from __future__ import annotations

import os

import pytest
import torch

from specdec.attention import QueryGroup
from specdec.kernels import cpu_ops
from tests.kernels.test_cpu_ops import ext, needs_kernels, tiny_steps
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(
    os.environ.get("SPECDEC_SLOW_TESTS") != "1", reason="SPECDEC_SLOW_TESTS=1"
)


@needs_kernels
def test_the_build_without_avx512_computes_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The portable code paths (what a CPU without AVX-512 runs), compiled here with
    ``-mno-avx512f``: a tiny model's logits as with torch's ops, linear rows row-invariant."""
    portable = cpu_ops._build(("-mno-avx512f",), "specdec_cpu_ops_portable")
    run = tiny_steps(tiny_model("qwen2"), torch.randint(0, 256, (24,)).tolist())  # a 4-row step
    monkeypatch.setattr(cpu_ops, "extension_for", lambda t: portable)
    got = run()
    monkeypatch.setattr(cpu_ops, "extension_for", lambda t: None)
    torch.testing.assert_close(got, run(), rtol=1e-5, atol=1e-5)
    x, w = torch.randn(9, 40), torch.randn(7, 40)
    packed = portable.pack_lanes(w)
    rows = torch.cat([portable.linear_lanes(x[i : i + 1], packed, None, 7) for i in range(9)])
    assert torch.equal(portable.linear_lanes(x, packed, None, 7), rows)
    torch.testing.assert_close(rows, x @ w.T, rtol=1e-5, atol=1e-5)
    # The float32 linear's bits are the native build's, every row count and partial block
    # (each output one chain of fused multiply-adds, whatever the vector width).
    for rows_, n_in, n_out in [(1, 576, 960), (5, 40, 7), (9, 1536, 13), (17, 13, 33)]:
        x, w, bias = torch.randn(rows_, n_in), torch.randn(n_out, n_in), torch.randn(n_out)
        packed = ext().pack_lanes(w)
        assert torch.equal(
            portable.linear_lanes(x, packed, bias, n_out),
            ext().linear_lanes(x, packed, bias, n_out),
        )


@needs_kernels
def test_vector_and_scalar_builds_give_the_same_bits() -> None:
    """The elementwise kernels compute each lane with the scalar code's operations: the native
    build, the AVX2 build (``-mno-avx512f``) and the scalar build agree bit for bit. The AVX2
    attention computes the AVX-512 attention's 16 lanes as two vectors of 8: float32 attention of
    the native and the AVX2 build agree too (the scalar attention sums in another order)."""
    builds = [
        ext(),
        cpu_ops._build(("-mno-avx512f",), "specdec_cpu_ops_portable"),
        cpu_ops._build(("-mno-avx512f", "-mno-avx2", "-mno-fma"), "specdec_cpu_ops_scalar"),
    ]
    torch.manual_seed(8)
    specials = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30])  # signed zeros, exp's clamps
    for dtype in (torch.float32, torch.bfloat16):
        for rows, n in [(3, 576), (5, 40), (2, 13)]:  # 40 and 13: rows with a scalar tail
            x, res = ((3 * torch.randn(rows, n)).to(dtype) for _ in "xr")
            w = torch.randn(n).to(dtype)
            gate_up = (4 * torch.randn(rows, 2 * n)).to(dtype)
            gate_up[0, :5], x[0, :5] = specials, specials
            cos, sin = (torch.randn(rows, 2 * n).to(dtype) for _ in "cs")  # a head of 2n
            outputs = [_elementwise(k, x, res, w, gate_up, cos, sin) for k in builds]
            for other in outputs[1:]:
                for a, b in zip(outputs[0], other):
                    assert torch.equal(a, b), (dtype, rows, n)
    q, k_cache, v_cache = (
        torch.randn(41, 9, 64),
        torch.randn(8, 16, 3, 64),
        torch.randn(8, 16, 3, 64),
    )
    group = QueryGroup.build([40, 1], [90, 128], [[3, 1, 7, 0, 2, 5], list(range(8))], [0, 40], 16,
                             invariant=True)  # fmt: skip
    attended = [
        k.cached_attention(
            q,
            k_cache,
            v_cache,
            group.query_index,
            group.key_slots,
            group.query_lens,
            group.context_lens,
            0.125,
        )  # fmt: skip
        for k in builds[:2]
    ]
    assert torch.equal(attended[0], attended[1])


def _elementwise(k, x, res, w, gate_up, cos, sin) -> list[torch.Tensor]:  # noqa: ANN001
    """Every elementwise kernel of build ``k`` on these inputs (RoPE on one head of 2n)."""
    residual, rotated = res.clone(), (3 * x).repeat(1, 2)
    k.rope_(rotated, cos, sin, 1, rotated.shape[1])
    normed = k.add_rms_norm_(residual, x, w, 1e-5)
    return [k.rms_norm(x, w, 1e-5), normed, residual, k.silu_mul(gate_up), rotated]
