"""specdec.models.linear: bf16 linears on oneDNN-packed weights, float32 ones on row kernels."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels import cpu_ops
from specdec.models import linear as linear_module
from specdec.models.linear import (
    SMALL_ROWS,
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
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("features", [(576, 960), (40, 7)])  # 40: no whole 16-lane blocks
def test_row_linear_rows_do_not_depend_on_the_row_count(
    bias: bool, features: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(*features, bias=bias)
    row_linear = RowLinear(linear)
    x = torch.randn(SMALL_ROWS + 8, features[0])
    with torch.inference_mode():
        one_by_one = torch.cat([row_linear(x[i : i + 1]) for i in range(SMALL_ROWS)])
        for rows in (2, 3, 4, 5, 6, 7, 9, 17, 35, SMALL_ROWS):  # every tile size, 1 to 6 rows
            assert torch.equal(row_linear(x[:rows]), one_by_one[:rows]), rows
        torch.testing.assert_close(one_by_one, linear(x[:SMALL_ROWS]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row_linear(x), linear(x))  # more rows: MKL


def test_float32_linears_use_the_row_kernels() -> None:
    hf = tiny_model("qwen2")  # q/k/v biases
    model = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), 64)
    assert isinstance(model.layers[0].self_attn.qkv_proj, RowLinear)
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied


@pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
def test_a_batch_invariant_bf16_model_runs_every_linear_on_packed_pairs() -> None:
    hf = tiny_model("llama")  # tied embeddings
    state = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    model = LlamaForCausalLM.from_hf(hf.config, state, 64, batch_invariant=True)
    assert model.batch_invariant
    rows = [m for m in model.modules() if isinstance(m, RowLinear)]
    assert len(rows) == 4 * hf.config.num_hidden_layers + 1
    assert all(m.max_rows is None and m.packed is not None and m.weight is None for m in rows)
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
    monkeypatch.setattr(linear_module, "vector_pair_kernels", lambda: True)
    monkeypatch.setattr(linear_module, "can_prepack", lambda dtype: onednn)
    plain = nn.Linear(64, 32).to(torch.bfloat16)
    model = nn.Sequential(nn.Linear(64, 32).to(torch.bfloat16))
    model[0].load_state_dict(plain.state_dict())
    assert use_row_kernels(model, invariant=False) == (0 if onednn else 1)
    if onednn:
        assert type(model[0]) is nn.Linear
        return
    assert isinstance(model[0], RowLinear) and model[0].packed is not None
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = model[0](x)
    expected = F.linear(x.float(), plain.weight.float(), plain.bias.float())
    torch.testing.assert_close(got.float(), expected, rtol=1.6e-2, atol=2e-2)


ROW_COUNTS = [*range(2, 19), 31, 32, 33, 64, 255, 256, 257, 300]  # register tiles of 1-8 rows,
# AMX tiles of 1-16, chunks of 256


def _check_rows(kernels, features: tuple[int, int], bias: bool) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    linear = nn.Linear(*features, bias=bias).to(torch.bfloat16)
    packed = kernels.pack_pairs(linear.weight.detach())
    b = None if linear.bias is None else linear.bias.detach()
    x = torch.randn(300, features[0]).to(torch.bfloat16)
    out = features[1]
    one_by_one = torch.cat([kernels.linear_pairs(x[i : i + 1], packed, b, out) for i in range(300)])
    for rows in ROW_COUNTS:
        assert torch.equal(kernels.linear_pairs(x[:rows], packed, b, out), one_by_one[:rows]), rows
    expected = F.linear(x.float(), linear.weight.float(), None if b is None else b.float())
    torch.testing.assert_close(one_by_one.float(), expected, rtol=1.6e-2, atol=2e-2)


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
    row_linear = RowLinear(linear, packed=True)
    x = torch.randn(5, features[0]).to(torch.bfloat16)
    with torch.inference_mode():
        got = row_linear(x.t().contiguous().t())  # a non-contiguous input is copied first
    torch.testing.assert_close(got.float(), linear(x).float(), rtol=1.6e-2, atol=2e-2)


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
@pytest.mark.skipif(
    not cpu_ops.enabled() or "avx512f" not in cpu_ops.cpu_flags().split(),
    reason="needs the AVX-512 kernels to compare with",
)
def test_row_linears_without_avx512_give_the_avx512_bits() -> None:
    """The AVX2 code (compiled here with ``-mno-avx512f``) runs the AVX-512 code's 16 lanes as
    two vectors of 8, with the same fused multiply-adds and the same tree: the same bits."""
    avx2 = cpu_ops._build(("-mno-avx512f",), "specdec_cpu_ops_avx2")
    torch.manual_seed(0)
    for features in [(576, 960), (1536, 576), (40, 7)]:
        w = torch.randn(features[1], features[0])  # float32: bf16 goes to linear_pairs
        b = torch.randn(features[1])
        x = torch.randn(9, features[0])
        assert torch.equal(avx2.linear(x, w, b), cpu_ops.extension().linear(x, w, b))


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
