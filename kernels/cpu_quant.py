"""Weight-only int4 and int8 linears: the weights' format, the kernel's layout and launcher, and
the torch reference.

A quantized weight ``W`` [out, in] is stored in groups of ``GROUP`` = 32 consecutive inputs of one
output feature, each group with a float16 scale ``d`` (and, for int4, a float16 minimum ``m``):

- **int4**, asymmetric: ``W = d * q + m`` with a code ``q`` in 0..15. This is GGUF's Q4_1
  (llama.cpp's "4-bit, scale and minimum per 32 weights"), value for value;
- **int8**, symmetric: ``W = d * q`` with ``q`` in -128..127. This is GGUF's Q8_0.

So GGUF files of those types load without re-quantizing. Activations are either kept in float (a
step computes ``x @ W.T`` in float32 from the codes) or quantized too, per row and group of 32
(``int8_activations``: ``x ~ dx * qx`` with ``dx = max |x| / 127``, ``qx = round(x / dx)``, as
llama.cpp's Q8_0), so that the kernel multiplies bytes with AVX-512 VNNI. Either way the kernel
(``cpu_quant.cpp``) gives each row the same bits whatever the row count.
:func:`quant_linear_reference`, which dequantizes ``W`` (and ``x``) and multiplies in float32, is
the specification; the kernel sums in another order (``d * sum q x + m * sum x`` per group), so
the two agree to float32 rounding, not bit for bit.

The kernel's layouts (:class:`PackedQuant`) run in blocks of 16 features and groups of 32 inputs;
scales, minimums and sums are ``[blocks][groups][16 features]``, and features past ``out`` are
zeros. For float activations the codes are ``[blocks][groups][32 inputs][16 features]`` bytes for
int8, and for int4 ``[blocks][groups][16 input pairs][16 features]`` bytes, each byte holding
input ``2p`` in its low nibble and ``2p + 1`` in its high one: one byte load per input (pair)
gives 16 features. For int8 activations each 64-byte line gives every feature four consecutive
inputs, as ``vpdpbusd`` takes them: int8 codes ``[blocks][groups][8 quads][16 features][4]``,
and int4 ``[blocks][groups][4 quads][16 features][4]`` bytes holding inputs ``4k + b`` in the low
nibble and ``16 + 4k + b`` in the high one. int8 weights under int8 activations also carry each
group's sum of codes (int16), because the kernel offsets the activations by 128 to make them the
instruction's unsigned operand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP = 32  # inputs per quantization group
BLOCK = 16  # output features per block of the kernel's layout


@dataclass(slots=True)
class QuantWeight:
    """A weight [out, in] quantized in groups of 32 inputs, in plain row-major form."""

    codes: torch.Tensor  # [out, in] uint8 codes 0..15 (int4) or int8 codes -128..127 (int8)
    scales: torch.Tensor  # [out, in / 32] float16 d
    mins: torch.Tensor | None = None  # [out, in / 32] float16 m (int4); None for int8

    def __post_init__(self) -> None:
        out, width = self.codes.shape
        if width % GROUP:
            raise ValueError(f"a quantized weight's input width ({width}) must be a multiple of 32")
        if self.codes.dtype not in (torch.uint8, torch.int8):
            raise ValueError(f"codes must be uint8 (int4) or int8, not {self.codes.dtype}")
        if self.scales.shape != (out, width // GROUP) or self.scales.dtype != torch.float16:
            raise ValueError(f"scales must be float16 [{out}, {width // GROUP}]")
        if (self.mins is None) != (self.bits == 8):
            raise ValueError("int4 weights (uint8 codes) need mins; int8 weights have none")

    @property
    def bits(self) -> int:
        return 4 if self.codes.dtype == torch.uint8 else 8

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        """``d * q (+ m)`` per weight, in float32 (as llama.cpp and gguf-py dequantize)."""
        d = self.scales.float().repeat_interleave(GROUP, dim=1)  # [out, in]
        w = d * self.codes.float()
        return w if self.mins is None else w + self.mins.float().repeat_interleave(GROUP, dim=1)

    def take_rows(self, index: torch.Tensor) -> QuantWeight:
        """The weight with its output features reordered (or selected) by ``index``."""
        mins = None if self.mins is None else self.mins[index]
        return QuantWeight(self.codes[index], self.scales[index], mins)


@dataclass(slots=True)
class PackedQuant:
    """A :class:`QuantWeight` in the kernel's layout (see the module docstring); 1-D tensors."""

    codes: torch.Tensor  # [blocks * groups * 16 * 32 * bits / 8] uint8
    scales: torch.Tensor  # [blocks * groups * 16] float16
    # like scales: float16 minimums (int4), int16 sums of codes (int8 under int8 activations)
    extra: torch.Tensor | None
    bits: int  # 4 or 8
    in_features: int
    out_features: int
    int8_activations: bool = False  # the layout for int8 activations (see the module docstring)

    @property
    def nbytes(self) -> int:
        tensors = [self.codes, self.scales] + ([] if self.extra is None else [self.extra])
        return sum(t.numel() * t.element_size() for t in tensors)


def pack(weight: QuantWeight, int8_activations: bool = False) -> PackedQuant:
    """``weight`` in the kernel's layout for float (or int8) activations."""
    out, width = weight.shape
    blocks, groups = -(-out // BLOCK), width // GROUP
    pad = blocks * BLOCK - out
    codes = F.pad(weight.codes.view(torch.uint8), (0, 0, 0, pad))  # [blocks * 16, in]
    if int8_activations:  # [blocks, groups, quads, 16, 4]
        quads = codes.view(blocks, BLOCK, groups, GROUP // 4, 4).permute(0, 2, 3, 1, 4)
        if weight.bits == 4:  # quads k and k + 4 share bytes: low nibble, high nibble
            quads = quads[:, :, :4] | (quads[:, :, 4:] << 4)
        codes = quads.contiguous().view(-1)
    else:
        if weight.bits == 4:  # inputs 2p and 2p + 1 share a byte: low nibble, high nibble
            pairs = codes.view(blocks, BLOCK, width // 2, 2)
            codes = pairs[..., 0] | (pairs[..., 1] << 4)  # [blocks, 16, in / 2]
        else:
            codes = codes.view(blocks, BLOCK, width)
        codes = codes.transpose(1, 2).contiguous().view(-1)  # [blocks, in (/ 2), 16]

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [out, groups] -> [blocks, groups, 16]
        return F.pad(t, (0, 0, 0, pad)).view(blocks, BLOCK, groups).transpose(1, 2).reshape(-1)

    extra = None if weight.mins is None else per_group(weight.mins)
    if int8_activations and weight.bits == 8:
        sums = weight.codes.view(out, groups, GROUP).to(torch.int16).sum(-1, dtype=torch.int16)
        extra = per_group(sums)
    return PackedQuant(
        codes, per_group(weight.scales), extra, weight.bits, width, out, int8_activations
    )


def unpack(packed: PackedQuant) -> QuantWeight:
    """The plain :class:`QuantWeight` of ``packed`` (the inverse of :func:`pack`)."""
    width, out = packed.in_features, packed.out_features
    blocks, groups = -(-out // BLOCK), width // GROUP
    if packed.int8_activations:
        quads = packed.codes.view(blocks, groups, -1, BLOCK, 4)
        if packed.bits == 4:
            quads = torch.cat((quads & 0xF, quads >> 4), dim=2)  # [blocks, groups, 8, 16, 4]
        codes = quads.permute(0, 3, 1, 2, 4).reshape(blocks * BLOCK, width)[:out]
    else:
        codes = packed.codes.view(blocks, -1, BLOCK).transpose(1, 2)  # [blocks, 16, in (/ 2)]
        if packed.bits == 4:
            codes = torch.stack((codes & 0xF, codes >> 4), dim=-1)  # [blocks, 16, in / 2, 2]
        codes = codes.reshape(blocks * BLOCK, width)[:out]
    if packed.bits == 8:
        codes = codes.view(torch.int8)

    def per_feature(t: torch.Tensor) -> torch.Tensor:  # [blocks, groups, 16] -> [out, groups]
        return t.view(blocks, groups, BLOCK).transpose(1, 2).reshape(-1, groups)[:out]

    mins = None if packed.bits == 8 or packed.extra is None else per_feature(packed.extra)
    return QuantWeight(codes.contiguous(), per_feature(packed.scales).contiguous(), mins)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, in] float32
    """``x`` rounded to int8 per row and group of 32 and back (``dx * qx``), as the kernel rounds
    it: ``dx = max |x| / 127``, ``qx = round(x * (1 / dx))`` half to even; below the smallest
    normal ``dx`` the group is zeros."""
    rows, width = x.shape
    groups = x.float().reshape(rows, width // GROUP, GROUP)
    d = groups.abs().amax(-1, keepdim=True) / 127
    d = torch.where(d >= torch.finfo(torch.float32).tiny, d, 0.0)
    inverse = torch.where(d == 0, 0.0, 1.0 / d)
    q = (groups * inverse).round().clamp(-127, 127)
    return (q * d).reshape(rows, width)


def quant_linear_reference(
    x: torch.Tensor,  # [N, in] float32 or bfloat16
    weight: QuantWeight,
    bias: torch.Tensor | None = None,  # [out]
    int8_activations: bool = False,
) -> torch.Tensor:  # [N, out] in x's dtype
    """``x @ W.T + bias`` with ``W`` dequantized (and ``x`` rounded to int8 per group, with
    ``int8_activations``), in float32, rounded once to ``x``'s dtype."""
    b = None if bias is None else bias.float()
    x32 = quantize_activations(x) if int8_activations else x.float()
    return F.linear(x32, weight.dequantize(), b).to(x.dtype)


def quant_linear(
    kernels: object,  # the compiled extension (specdec.kernels.cpu_ops.extension())
    x: torch.Tensor,  # [N, in] float32 or bfloat16, contiguous
    packed: PackedQuant,
    bias: torch.Tensor | None = None,  # [out] in x's dtype
) -> torch.Tensor:  # [N, out] in x's dtype
    """``x @ W.T + bias`` on the C++ kernel (row-invariant; see ``cpu_quant.cpp``)."""
    return kernels.quant_linear(  # type: ignore[attr-defined]
        x,
        packed.codes,
        packed.scales,
        packed.extra,
        bias,
        packed.bits,
        packed.out_features,
        packed.int8_activations,
    )
