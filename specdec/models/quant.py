"""Quantization of a native model's linear layers: int4 and int8 weights in groups of 32, with
float or int8 activations.

``quantization="int4"`` runs every linear of the decoder layers on asymmetric int4 codes (GGUF's
Q4_1) and the output layer on symmetric int8 (GGUF's Q8_0): the output layer is the most
sensitive matrix, and measured on the default model a 4-bit head agreed with the float32 model
on 87% of greedy next tokens against 99% for an 8-bit one. ``quantization="int8"`` runs every
linear, the output layer included, on int8. Both are weight-only: the activations stay in the
model's dtype, as do embeddings, norms and biases.

``"w4a8"`` and ``"w8a8"`` hold the same weights as ``"int4"`` and ``"int8"`` and also round each
linear's input to int8 per row and group of 32 (llama.cpp's Q8_0 activations), so that the
kernel multiplies bytes with AVX-512 VNNI (``vpdpbusd``, 64 multiply-adds per instruction
against 16 for a float FMA): faster, and no longer the dequantized weights' exact function.
llama.cpp computes its Q4_1 and Q8_0 layers this way.

Weights that arrive quantized (a GGUF file's Q4_1 and Q8_0 tensors, see
:func:`specdec.gguf.read_quantized`) are kept as they are; the others are quantized here, with
llama.cpp's rules, so that a float checkpoint and its GGUF conversion give the same codes:

- int4: ``d = (max - min) / 15`` and ``m = min`` over the group, ``q = trunc((w - m) / d + 0.5)``;
- int8: ``d = max |w| / 127``, ``q = round(w / d)``;

with ``d`` and ``m`` stored as float16 (gguf-py's ``Q4_1`` and ``Q8_0`` ``quantize_blocks``).

Every quantized linear runs the row-invariant kernel of ``kernels/cpu_quant.cpp`` for every row
count, so a quantized model is batch-invariant in its linears whatever its dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from specdec.kernels import cpu_ops
from specdec.kernels.cpu_quant import (
    GROUP,
    PackedQuant,
    QuantWeight,
    pack,
    quant_linear,
    quant_linear_reference,
    quantize_activations,
    unpack,
)

QUANTIZATIONS = ("int8", "int4", "w8a8", "w4a8")  # EngineConfig.quantization besides None
HEAD_BITS = 8  # the output layer keeps 8 bits under int4 (see the module docstring)

logger = logging.getLogger(__name__)


def weight_bits(quantization: str, head: bool) -> int:
    """The bits of a linear's weights under ``quantization`` (the output layer if ``head``)."""
    return HEAD_BITS if head or quantization in ("int8", "w8a8") else 4


def int8_activations(quantization: str) -> bool:
    """Whether ``quantization`` rounds the linears' inputs to int8 too."""
    return quantization in ("w8a8", "w4a8")


def fast_int8_activations() -> bool:
    """Whether int8 activations run vector code here: AVX-512 VNNI, or AVX2's byte products
    (``vpmaddubsw``); elsewhere the kernel's scalar loop."""
    flags = cpu_ops.cpu_flags().split()
    return cpu_ops.enabled() and ("avx512_vnni" in flags or "avx2" in flags)


def default_draft_quantization() -> str:
    """``quantized_self``'s weights when none is asked for: ``"w4a8"`` where int8 activations
    run vector code (AVX-512 VNNI, or AVX2), else ``"int4"``. Side by side against ``"int4"``
    drafts, with a bf16 target: 1.13x with VNNI (accepted a little less often, 0.96 against
    0.99, at less cost), 1.07x on an AVX2 CPU without AVX-512 (14 first turns of the bench's
    questions, 96 new tokens, two rounds in one process)."""
    return "w4a8" if fast_int8_activations() else "int4"


def check_quantization(quantization: str | None) -> str | None:
    """``quantization`` if it is one this engine runs (or None), else a ValueError."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r}: use one of {', '.join(QUANTIZATIONS)} or None"
        )
    return quantization


def quantize(weight: torch.Tensor, bits: int) -> QuantWeight:
    """``weight`` [out, in] quantized in groups of 32 (``bits`` 4: asymmetric, 8: symmetric)."""
    out, width = weight.shape
    if width % GROUP:
        raise ValueError(
            f"cannot quantize a linear whose input width ({width}) is not a multiple of 32"
        )
    groups = weight.detach().float().reshape(out, width // GROUP, GROUP)  # [out, G, 32]
    if bits == 4:  # gguf-py's Q4_1: q = trunc((w - min) / d + 0.5), with d in float32
        low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        d = (high - low) / 15  # [out, G, 1]
        inverse = torch.where(d == 0, 0.0, 1.0 / d)
        codes = torch.trunc((groups - low) * inverse + 0.5).clamp(0, 15).to(torch.uint8)
        scales, mins = d.squeeze(-1).half(), low.squeeze(-1).half()
        return QuantWeight(codes.reshape(out, width), scales, mins)
    if bits == 8:  # gguf-py's Q8_0: q = round(w / d), halves to even
        d = groups.abs().amax(dim=-1, keepdim=True) / 127
        inverse = torch.where(d == 0, 0.0, 1.0 / d)
        codes = (groups * inverse).round().clamp(-128, 127).to(torch.int8)
        return QuantWeight(codes.reshape(out, width), d.squeeze(-1).half())
    raise ValueError(f"bits must be 4 or 8, not {bits}")


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held quantized (int4 or int8, groups of 32) and ``x`` in
    float or, with ``int8_activations``, rounded to int8 per group; inference only.

    Runs the C++ kernel for every row count; without the kernels, the torch reference, which
    dequantizes the weight on every call (correct, much slower).
    """

    def __init__(
        self,
        weight: QuantWeight,
        bias: torch.Tensor | None = None,
        int8_activations: bool = False,
    ):
        super().__init__()
        packed = pack(weight, int8_activations)
        self.bits, self.in_features, self.out_features = (
            packed.bits,
            packed.in_features,
            packed.out_features,
        )
        self.int8_activations = int8_activations
        # Frozen parameters, not buffers, so that the model's weights arena (huge pages, see
        # models/hugepages.py) takes them as it takes float weights. ``extra``: the minimums of
        # int4 weights, or the group sums of int8 codes under int8 activations (see cpu_quant.py).
        self.codes = nn.Parameter(packed.codes, requires_grad=False)
        self.scales = nn.Parameter(packed.scales, requires_grad=False)
        self.extra = (
            None if packed.extra is None else nn.Parameter(packed.extra, requires_grad=False)
        )
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # The kernel's arguments, made once: building them from the parameters on every call
        # (nn.Module attribute lookups) cost 0.7 ms of a 12 ms int4 decode step. They hold the
        # parameter objects, which moving the weights (``p.data = ...``) keeps.
        self.__dict__["_packed"] = PackedQuant(
            self.codes,
            self.scales,
            self.extra,
            self.bits,
            self.in_features,
            self.out_features,
            int8_activations,
        )

    @property
    def packed(self) -> PackedQuant:
        return self.__dict__["_packed"]

    @property
    def weight_nbytes(self) -> int:
        return self.packed.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        kernels = cpu_ops.extension_for(x)
        bias = (
            self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        )
        packed = self.__dict__["_packed"]
        if kernels is not None:
            return quant_linear(kernels, x.contiguous(), packed, bias)
        return quant_linear_reference(x, unpack(packed), bias, self.int8_activations)

    def extra_repr(self) -> str:
        activations = ", int8 activations" if self.int8_activations else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int{self.bits}{activations}"
        )


def quantize_linears(
    model: nn.Module,
    quantization: str,
    prequantized: dict[str, QuantWeight] | None = None,
) -> int:
    """Replace the linears of ``model`` by :class:`QuantLinear`s; return how many.

    ``prequantized`` maps a linear's module name (``layers.0.mlp.down_proj``, ``lm_head``) to
    weights that arrived quantized; they are used as they are when their bits are the ones this
    ``quantization`` asks for, and the others are quantized from the float weights.
    """
    check_quantization(quantization)
    if int8_activations(quantization) and not fast_int8_activations():
        logger.warning(
            "quantization %r rounds activations to int8, which runs fast only with AVX-512 VNNI "
            "or AVX2; this CPU lacks both, so %r runs scalar code: use %r here",
            quantization,
            quantization,
            "int4" if quantization == "w4a8" else "int8",
        )
    prequantized = prequantized or {}
    swaps = [
        (parent, f"{prefix}.{name}".lstrip("."), name, child)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, full_name, name, child in swaps:
        bits = weight_bits(quantization, head=full_name == "lm_head")
        given = prequantized.get(full_name)
        weight = given if given is not None and given.bits == bits else quantize(child.weight, bits)
        setattr(parent, name, QuantLinear(weight, child.bias, int8_activations(quantization)))
    return len(swaps)


def dequantized_linears(model: nn.Module, quantization: str) -> nn.Module:
    """``model`` (a ``transformers`` model) with each linear's weight replaced, in place, by the
    dequantized value of what :func:`quantize_linears` would hold for it (and, under int8
    activations, each linear's input rounded as the kernel rounds it); a tied output layer gets a
    weight of its own, so lookups keep the float embedding, as in the engine. For measuring a
    quantization's effect on quality apart from the kernels' rounding."""
    check_quantization(quantization)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            bits = weight_bits(quantization, head=name.split(".")[-1] == "lm_head")
            dequantized = quantize(module.weight, bits).dequantize().to(module.weight.dtype)
            module.weight = nn.Parameter(dequantized, requires_grad=False)
            if int8_activations(quantization):
                module.register_forward_pre_hook(_round_input)
    return model


def _round_input(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    x = args[0]
    rows = quantize_activations(x.reshape(-1, x.shape[-1])).to(x.dtype)
    return (rows.reshape(x.shape), *args[1:])
