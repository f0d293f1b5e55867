"""The int4/int8 linear kernel (float or int8 activations) against its torch reference, and its
row invariance."""

from __future__ import annotations

import os

import pytest
import torch

from specdec.kernels import cpu_ops
from specdec.kernels.cpu_quant import (
    QuantWeight,
    pack,
    quant_linear,
    quant_linear_reference,
    quantize_activations,
    unpack,
)
from specdec.models.quant import quantize

needs_kernels = pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 14, 16, 17, 33, 127, 128, 129, 200]  # 16s: AMX tiles;
# from 12 on, AVX2's wide tiles of 3 rows (12, 13, 14: a full last tile, then 1 and 2 rows of it)
SHAPES = [(576, 960), (1536, 576), (64, 40), (96, 7)]  # (in, out); 40 and 7: a padded block


def random_weight(shape: tuple[int, int], bits: int, seed: int = 0) -> QuantWeight:
    torch.manual_seed(seed)
    width, out = shape
    return quantize(torch.randn(out, width) * 0.05, bits)


A8 = [False, True]  # int8_activations


@pytest.mark.parametrize("int8_activations", A8)
@pytest.mark.parametrize("bits", [4, 8])
def test_pack_and_unpack_are_inverse(bits: int, int8_activations: bool) -> None:
    weight = random_weight((96, 40), bits)
    back = unpack(pack(weight, int8_activations))
    assert torch.equal(back.codes, weight.codes) and torch.equal(back.scales, weight.scales)
    assert (back.mins is None) == (weight.mins is None)
    if weight.mins is not None:
        assert torch.equal(back.mins, weight.mins)


@pytest.mark.parametrize("bits, worst", [(4, 0.5 / 15), (8, 0.5 / 127)])
def test_quantization_error_is_half_a_step(bits: int, worst: float) -> None:
    """Each weight is within half a quantization step (plus float16 scale rounding) of itself."""
    torch.manual_seed(1)
    w = torch.randn(48, 128)
    groups = w.reshape(48, 4, 32)
    span = groups.amax(-1) - groups.amin(-1) if bits == 4 else groups.abs().amax(-1)
    error = (quantize(w, bits).dequantize() - w).abs().reshape(48, 4, 32).amax(-1)
    assert (error <= span * worst * 1.01 + 1e-3 * span).all()


def test_activations_round_to_int8_per_group() -> None:
    """Each group of 32 becomes ``dx * qx`` with ``dx = max |x| / 127``: within half a step of
    itself, its largest entry kept, and a group of zeros (or of denormals) all zeros."""
    torch.manual_seed(3)
    x = torch.randn(4, 96) * torch.tensor([1e-3, 1.0, 30.0]).repeat_interleave(32)
    x[3, :32] = 1e-39  # below 127 * the smallest normal: the group rounds to zeros
    rounded = quantize_activations(x)
    step = x.abs().reshape(4, 3, 32).amax(-1, keepdim=True) / 127
    error = (rounded - x).abs().reshape(4, 3, 32)
    assert (error[:3] <= step[:3] * 0.5001).all()
    assert torch.equal(rounded[3, :32], torch.zeros(32))
    peaks = x.abs().reshape(4, 3, 32).argmax(-1, keepdim=True)
    kept = rounded.reshape(4, 3, 32).gather(-1, peaks) - x.reshape(4, 3, 32).gather(-1, peaks)
    assert (kept.abs()[:3] <= step[:3] * 1e-5).all()


@needs_kernels
@pytest.mark.parametrize("int8_activations", A8)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_the_dequantizing_reference(bits, dtype, shape, int8_activations) -> None:
    """Within float32 rounding of a sum of `in` products (float32), or one bf16 ulp (bf16).

    With int8 activations the kernel rounds ``x`` as the reference does (a rounding tie that went
    the other way would move a product by a whole step and fail the tolerance)."""
    weight = random_weight(shape, bits)
    bias = torch.randn(shape[1]).to(dtype)
    x = torch.randn(9, shape[0]).to(dtype)
    got = quant_linear(cpu_ops.extension(), x, pack(weight, int8_activations), bias)
    expected = quant_linear_reference(x, weight, bias, int8_activations)
    assert got.dtype == dtype and got.shape == expected.shape
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_activations_quantize_as_their_float32_values(bits: int) -> None:
    """A bfloat16 row is quantized to int8 as read, widened exactly: the same codes, scales and
    sums as the float32 row of the same values, so the same float32 totals before the output's
    rounding to bf16."""
    packed = pack(random_weight((576, 100), bits), True)
    x = (torch.randn(9, 576) * torch.logspace(-3, 2, 576)).to(torch.bfloat16)
    from_bf16 = quant_linear(cpu_ops.extension(), x, packed)
    from_float = quant_linear(cpu_ops.extension(), x.float(), packed)
    assert torch.equal(from_bf16, from_float.to(torch.bfloat16))


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activation_sums_at_their_extremes(bits: int) -> None:
    """Codes and activations at their largest magnitudes, with one sign through a whole group:
    the integer sums the byte products build (in int16 lanes for a while on AVX2) stay exact, so
    the kernel gives the reference's result for 1 row and for tiles of several."""
    out, width = 24, 96
    extreme = 15 if bits == 4 else -128
    codes = torch.full((out, width), extreme, dtype=torch.uint8 if bits == 4 else torch.int8)
    codes[1::2, 32:64] = 0 if bits == 4 else 127  # features whose second group has the other end
    scales = torch.full((out, width // 32), 0.5, dtype=torch.float16)
    mins = torch.zeros_like(scales) if bits == 4 else None
    weight = QuantWeight(codes, scales, mins)
    x = torch.ones(5, width) * torch.tensor([1.0, -1.0, 3.0, -2.0, 0.5]).view(5, 1)
    x[2, 40] = 0.01  # one group whose codes are not all 127
    packed = pack(weight, True)
    expected = quant_linear_reference(x, weight, None, True)
    for rows in (1, 2, 5):
        got = quant_linear(cpu_ops.extension(), x[:rows], packed)
        torch.testing.assert_close(got, expected[:rows], rtol=1e-5, atol=1e-3)


def _check_rows(kernels, bits: int, dtype: torch.dtype, int8_activations: bool) -> None:  # noqa: ANN001
    for shape in SHAPES:
        packed = pack(random_weight(shape, bits), int8_activations)
        x = torch.randn(max(ROW_COUNTS), shape[0]).to(dtype)
        alone = torch.cat([quant_linear(kernels, x[i : i + 1], packed) for i in range(len(x))])
        for rows in ROW_COUNTS:
            together = quant_linear(kernels, x[:rows], packed)
            assert torch.equal(together, alone[:rows]), (shape, rows)


@needs_kernels
@pytest.mark.parametrize("int8_activations", A8)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_row_count(bits, dtype, int8_activations) -> None:
    """A row gets the same bits alone, in a tile of 2-8, in a 16-row AMX tile (int8 activations,
    where the CPU has AMX), in AVX2's wide tiles (float activations, chunks of 12 rows or more),
    and across the 128-row chunks."""
    _check_rows(cpu_ops.extension(), bits, dtype, int8_activations)


@pytest.mark.skipif(os.environ.get("SPECDEC_SLOW_TESTS") != "1", reason="SPECDEC_SLOW_TESTS=1")
@needs_kernels
@pytest.mark.parametrize("build", ["no-amx", "avx2", "scalar"])
def test_other_builds_give_the_same_bits(build: str) -> None:
    """The code of CPUs unlike this one, compiled here, gives this machine's bits: vpdpbusd tiles
    alone (no AMX), the AVX2 code (no AVX-512) and the scalar code (neither). Rows in 16-row
    tiles are AMX's where this CPU has it."""
    flags = {
        "no-amx": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
        "avx2": ("-mno-avx512f",),
        "scalar": ("-mno-avx512f", "-mno-avx2"),
    }[build]
    other = cpu_ops._build(flags, f"specdec_cpu_ops_{build.replace('-', '_')}")
    for bits in (4, 8):
        for int8_activations in A8:
            for dtype in (torch.float32, torch.bfloat16):  # bf16 rows are read as bf16
                _check_rows(other, bits, dtype, int8_activations)
                packed = pack(random_weight((576, 40), bits), int8_activations)
                x = torch.randn(40, 576).to(dtype)
                assert torch.equal(
                    quant_linear(other, x, packed), quant_linear(cpu_ops.extension(), x, packed)
                )


@needs_kernels
def test_kernel_rejects_mismatched_arguments() -> None:
    kernels, packed = cpu_ops.extension(), pack(random_weight((64, 40), 4))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.quant_linear(
            torch.randn(2, 48), packed.codes, packed.scales, packed.extra, None, 4, 40, False
        )
    with pytest.raises(RuntimeError, match="codes must be the packed"):
        kernels.quant_linear(
            torch.randn(2, 96), packed.codes, packed.scales, packed.extra, None, 4, 40, False
        )
    with pytest.raises(RuntimeError, match="int4 weights need mins"):
        kernels.quant_linear(
            torch.randn(2, 64), packed.codes, packed.scales, None, None, 4, 40, False
        )
    with pytest.raises(RuntimeError, match="bias must have"):
        quant_linear(kernels, torch.randn(2, 64), packed, torch.randn(41))
    int8 = pack(random_weight((64, 40), 8), int8_activations=True)
    with pytest.raises(RuntimeError, match="int8 activations need the codes' group sums"):
        kernels.quant_linear(torch.randn(2, 64), int8.codes, int8.scales, None, None, 8, 40, True)
    with pytest.raises(RuntimeError, match="sums must be packed int16"):
        kernels.quant_linear(
            torch.randn(2, 64), int8.codes, int8.scales, int8.scales, None, 8, 40, True
        )


def test_quant_weights_refuse_bad_shapes() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(8, 40), 4)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize(torch.randn(8, 64), 3)
    with pytest.raises(ValueError, match="need mins"):
        QuantWeight(torch.zeros(8, 64, dtype=torch.uint8), torch.zeros(8, 2).half())
