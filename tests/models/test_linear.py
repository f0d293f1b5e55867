"""specdec.models.linear: bf16 linears on oneDNN-packed weights or packed pairs, float32 ones
packed in lanes."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels import cpu_ops
from specdec.models import linear as linear_module
from specdec.models.linear import (
    PackedLinear,
    RowLinear,
    can_prepack,
    prepack_linears,
    use_row_kernels,
)
from specdec.models.llama import LlamaForCausalLM
from tests.tiny import tiny_model

needs_onednn = pytest.mark.skipif(not can_prepack(torch.bfloat16), reason="no oneDNN bf16")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_packed_linear_computes_what_f_linear_computes(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected, got = linear(x), PackedLinear(linear)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-2)


def test_only_bfloat16_is_packed() -> None:
    assert not can_prepack(torch.float32)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert prepack_linears(model) == 0 and isinstance(model[0], nn.Linear)


@needs_onednn
def test_a_bf16_model_is_packed_at_load_and_keeps_its_embedding() -> None:
    hf = tiny_model("llama")  # tied embeddings
    state = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    model = LlamaForCausalLM.from_hf(hf.config, state, 64, batch_invariant=False)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert not linears and len(packed) == 4 * hf.config.num_hidden_layers + 1
    assert torch.equal(model.embed_tokens.weight, state["model.embed_tokens.weight"])
    hidden = torch.randn(2, hf.config.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    expected = hidden @ state["model.embed_tokens.weight"].T
    torch.testing.assert_close(logits, expected, rtol=1.6e-2, atol=1e-2)
    fp32 = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), 64)
    assert not any(isinstance(m, PackedLinear) for m in fp32.modules())


@pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
def test_float32_linears_are_packed_in_lanes_and_the_embedding_keeps_its_rows() -> None:
    hf = tiny_model("qwen2")  # q/k/v biases, tied embeddings
    state = hf.state_dict()
    model = LlamaForCausalLM.from_hf(hf.config, state, 64)
    rows = [m for m in model.modules() if isinstance(m, RowLinear)]
    assert len(rows) == 4 * hf.config.num_hidden_layers + 1
    assert all(m.layout == "lanes" and not hasattr(m, "weight") for m in rows)
    assert not any(type(m) is nn.Linear for m in model.modules())
    embedding = state["model.embed_tokens.weight"]
    assert torch.equal(model.embed_tokens.weight, embedding)
    hidden = torch.randn(3, hf.config.hidden_size)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits, hidden @ embedding.T, rtol=1e-5, atol=1e-5)


def test_without_the_kernels_float32_linears_stay_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_ops, "enabled", lambda: False)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert use_row_kernels(model) == 0 and type(model[0]) is nn.Linear


@pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
def test_a_batch_invariant_bf16_model_runs_every_linear_on_packed_pairs() -> None:
    hf = tiny_model("llama")  # tied embeddings
    state = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    model = LlamaForCausalLM.from_hf(hf.config, state, 64, batch_invariant=True)
    assert model.batch_invariant
    rows = [m for m in model.modules() if isinstance(m, RowLinear)]
    assert len(rows) == 4 * hf.config.num_hidden_layers + 1
    assert all(m.layout == "pairs" and not hasattr(m, "weight") for m in rows)
    # no plain copy is kept beside the packed one; the embedding keeps its rows for lookups
    assert torch.equal(model.embed_tokens.weight, state["model.embed_tokens.weight"])
    hidden = torch.randn(3, hf.config.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    expected = hidden.float() @ state["model.embed_tokens.weight"].float().T
    torch.testing.assert_close(logits.float(), expected, rtol=1.6e-2, atol=2e-2)


@pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
@pytest.mark.parametrize("onednn", [False, True])
def test_bf16_without_invariance_packs_pairs_only_where_onednn_cannot_pack(
    onednn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without invariance, bf16 linears on an AVX2 CPU (pair kernel in vector code, no oneDNN
    bf16 packing) run the pair kernel, not ``F.linear``; where oneDNN packs, they are left to it."""
    monkeypatch.setattr(linear_module, "vector_row_kernels", lambda: True)
    monkeypatch.setattr(linear_module, "can_prepack", lambda dtype: onednn)
    plain = nn.Linear(64, 32).to(torch.bfloat16)
    model = nn.Sequential(nn.Linear(64, 32).to(torch.bfloat16))
    model[0].load_state_dict(plain.state_dict())
    assert use_row_kernels(model, invariant=False) == (0 if onednn else 1)
    if onednn:
        assert type(model[0]) is nn.Linear
        return
    assert isinstance(model[0], RowLinear) and model[0].layout == "pairs"
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = model[0](x)
    expected = F.linear(x.float(), plain.weight.float(), plain.bias.float())
    torch.testing.assert_close(got.float(), expected, rtol=1.6e-2, atol=2e-2)


ROW_COUNTS = [*range(2, 19), 31, 32, 33, 64, 255, 256, 257, 300]  # register tiles of 1-8 rows,
# AMX tiles of 1-16, chunks of 256


def _check_rows(kernels, features: tuple[int, int], bias: bool, dtype=torch.bfloat16) -> None:  # noqa: ANN001
    """Every row count gives each row the bits it gets alone, and the rows are close to
    ``F.linear`` in float64; bfloat16 packed in pairs, float32 in lanes."""
    torch.manual_seed(0)
    linear = nn.Linear(*features, bias=bias).to(dtype)
    pack, run = (
        (kernels.pack_pairs, kernels.linear_pairs)
        if dtype == torch.bfloat16
        else (kernels.pack_lanes, kernels.linear_lanes)
    )
    packed = pack(linear.weight.detach())
    b = None if linear.bias is None else linear.bias.detach()
    x = torch.randn(300, features[0]).to(dtype)
    out = features[1]
    one_by_one = torch.cat([run(x[i : i + 1], packed, b, out) for i in range(300)])
    for rows in ROW_COUNTS:
        assert torch.equal(run(x[:rows], packed, b, out), one_by_one[:rows]), rows
    assert torch.equal(run(x[7:16], packed, b, out), one_by_one[7:16])  # rows at any offset
    w64 = linear.weight.double()
    expected = F.linear(x.double(), w64, None if b is None else b.double())
    if dtype == torch.bfloat16:
        torch.testing.assert_close(one_by_one.double(), expected, rtol=1.6e-2, atol=2e-2)
    else:  # a chain of `in` roundings, each at most half an ulp of a partial sum
        bound = 1e-6 * features[0] * (x.double().abs() @ w64.abs().T + 1)
        assert ((one_by_one.double() - expected).abs() <= bound).all()


FEATURES = [(1536, 576), (576, 960), (40, 7), (41, 70)]  # odd widths: a pair and a step padded


@pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("features", FEATURES)
def test_bf16_packed_rows_do_not_depend_on_the_row_count(
    bias: bool, features: tuple[int, int]
) -> None:
    """Every row count from 1 to 300 gives each row the bits it gets alone (on this machine's
    path: AMX tiles where the CPU has them, else vdpbf16ps); 1536 inputs is the down projection
    whose rows oneDNN changes on CPUs without AMX."""
    _check_rows(cpu_ops.extension(), features, bias)
    linear = nn.Linear(*features, bias=bias).to(torch.bfloat16)
    row_linear = RowLinear(linear)
    x = torch.randn(5, features[0]).to(torch.bfloat16)
    with torch.inference_mode():
        got = row_linear(x.t().contiguous().t())  # a non-contiguous input is copied first
    torch.testing.assert_close(got.float(), linear(x).float(), rtol=1.6e-2, atol=2e-2)


@pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("features", FEATURES)
def test_float32_lane_rows_do_not_depend_on_the_row_count(
    bias: bool, features: tuple[int, int]
) -> None:
    """Every tile shape (1 row over 4 blocks, 2-3 over 2, tiles of up to 5 rows, of 6 from 12
    rows on, chunks of 256) gives each row its bits alone; 40 and 41 outputs: a partial block."""
    _check_rows(cpu_ops.extension(), features, bias, torch.float32)
    linear = nn.Linear(*features, bias=bias)
    row_linear = RowLinear(linear)
    x = torch.randn(5, features[0])
    with torch.inference_mode():
        got = row_linear(x.t().contiguous().t())  # a non-contiguous input is copied first
    torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(os.environ.get("SPECDEC_SLOW_TESTS") != "1", reason="SPECDEC_SLOW_TESTS=1")
@pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
@pytest.mark.parametrize("build", ["no-amx", "no-avx512bf16", "avx2", "scalar"])
def test_bf16_packed_rows_are_invariant_on_every_path(build: str) -> None:
    """The paths of CPUs unlike this one, compiled here: vdpbf16ps without AMX, float32 fused
    multiply-adds without AVX512-BF16, AVX2 without AVX-512, and scalar code without either."""
    flags = {
        "no-amx": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
        "no-avx512bf16": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8", "-mno-avx512bf16"),
        "avx2": ("-mno-avx512f",),
        "scalar": ("-mno-avx512f", "-mno-avx2"),
    }[build]
    kernels = cpu_ops._build(flags, f"specdec_cpu_ops_{build.replace('-', '_')}")
    for features in FEATURES:
        _check_rows(kernels, features, bias=True)


@pytest.mark.skipif(os.environ.get("SPECDEC_SLOW_TESTS") != "1", reason="SPECDEC_SLOW_TESTS=1")
@pytest.mark.skipif(
    not cpu_ops.enabled() or "avx2" not in cpu_ops.cpu_flags().split(),
    reason="needs a CPU that runs the AVX2 code",
)
def test_bf16_pairs_without_avx512_give_the_scalar_bits() -> None:
    """The AVX2 pair kernel adds each input pair as the scalar code does (even product, then
    odd, each exact in float32), 8 features to a vector: the same bits for every tile shape it
    picks (1 row over 4 blocks, 2-3 rows over 2, up to 11 rows over 1, and from 12 rows on
    tiles of 6 rows read from a widened panel, the last tile partly spare)."""
    avx2 = cpu_ops._build(("-mno-avx512f",), "specdec_cpu_ops_avx2")
    scalar = cpu_ops._build(("-mno-avx512f", "-mno-avx2"), "specdec_cpu_ops_scalar")
    torch.manual_seed(0)
    for features in FEATURES:
        w = torch.randn(features[1], features[0]).to(torch.bfloat16)
        b = torch.randn(features[1]).to(torch.bfloat16)
        packed = avx2.pack_pairs(w)
        assert torch.equal(packed, scalar.pack_pairs(w))
        for rows in (1, 2, 3, 9, 11, 12, 17, 260):
            x = torch.randn(rows, features[0]).to(torch.bfloat16)
            got = avx2.linear_pairs(x, packed, b, features[1])
            assert torch.equal(got, scalar.linear_pairs(x, packed, b, features[1])), rows


@pytest.mark.skipif(os.environ.get("SPECDEC_SLOW_TESTS") != "1", reason="SPECDEC_SLOW_TESTS=1")
@pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
def test_float32_lanes_give_the_same_bits_on_every_build() -> None:
    """Each output is one chain of fused multiply-adds whatever the vector width: the native
    build, the AVX2 build (``-mno-avx512f``) and the scalar one (``std::fma``) agree bit for
    bit, for every tile shape."""
    builds = [
        cpu_ops.extension(),
        cpu_ops._build(("-mno-avx512f",), "specdec_cpu_ops_avx2"),
        cpu_ops._build(("-mno-avx512f", "-mno-avx2"), "specdec_cpu_ops_scalar"),
    ]
    torch.manual_seed(0)
    for features in FEATURES:
        w, b = torch.randn(features[1], features[0]), torch.randn(features[1])
        packed = builds[0].pack_lanes(w)
        for rows in (1, 2, 3, 5, 9, 12, 17, 260):
            x = torch.randn(rows, features[0])
            got = [k.linear_lanes(x, packed, b, features[1]) for k in builds]
            assert all(torch.equal(got[0], other) for other in got[1:]), (features, rows)


@pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
def test_packed_linears_reject_mismatched_arguments() -> None:
    kernels = cpu_ops.extension()
    w = torch.randn(20, 48).to(torch.bfloat16)
    packed = kernels.pack_pairs(w)
    x = torch.randn(2, 48).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="packed must come from pack_pairs"):
        kernels.linear_pairs(torch.randn(2, 80).to(torch.bfloat16), packed, None, 20)
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D bfloat16"):
        kernels.linear_pairs(x.float(), packed, None, 20)
    with pytest.raises(RuntimeError, match="bias must be bfloat16"):
        kernels.linear_pairs(x, packed, torch.zeros(19, dtype=torch.bfloat16), 20)
    with pytest.raises(RuntimeError, match="weight must be a contiguous"):
        kernels.pack_pairs(w.float())
    lanes = kernels.pack_lanes(w.float())
    with pytest.raises(RuntimeError, match="packed must come from pack_lanes"):
        kernels.linear_lanes(torch.randn(2, 80), lanes, None, 20)
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D float32"):
        kernels.linear_lanes(x, lanes, None, 20)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        kernels.linear_lanes(x.float(), lanes, torch.zeros(19), 20)
    with pytest.raises(RuntimeError, match="packed must be 32-byte aligned"):
        kernels.linear_lanes(x.float(), torch.zeros(lanes.numel() + 1)[1:], None, 20)
    with pytest.raises(RuntimeError, match="weight must be a contiguous"):
        kernels.pack_lanes(w)
    with pytest.raises(ValueError, match="float32 or bfloat16 weights"):
        RowLinear(nn.Linear(4, 4).double())
