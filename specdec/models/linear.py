"""Linear layers for the CPU: oneDNN-packed bfloat16 weights, and the row-invariant C++ kernel.

``F.linear`` on bfloat16 CPU tensors hands every call to oneDNN with the weight in its plain
``[out, in]`` layout, and a single-token decode step makes about 120 such calls. Packing each
weight once, into the blocked layout oneDNN's bf16 GEMM kernels read, is what PyTorch's Inductor
does when it freezes a CPU graph (``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``); :class:`PackedLinear` does that for bfloat16 models that need not be
batch-invariant.

:class:`RowLinear` runs the C++ kernels, which give each row the same bits whatever the row
count. Float32 weights are packed once with 16 output features to a 64-byte line
(``kernels/cpu_lanes.cpp``): each output is one chain of fused multiply-adds over its inputs, and
every row count runs the kernel, decodes, verifications and prompt chunks alike. Side by side on
2 AVX2 cores (the default model's 120 decoder linears, one process, interleaved), against the
row kernel that held the weights as ``[out, in]`` and added 16 lanes across at the end: 1 row
1.06x, 3 rows 1.37x, 9 rows 1.56-1.63x, 33 rows 1.45-1.80x, 64 rows 1.53x; against MKL, which
float32 steps of more than 64 rows used to take, 1.13-1.39x at 128 rows and 0.97-1.03x at
256-512. So float32 linears are batch-invariant at no cost, with one copy of the weights.
Batch-invariant bfloat16 models (see :mod:`specdec.attention`) pack every weight once in input
pairs (``kernels/cpu_linear.cpp``) and run every row count on the kernel: AMX tiles where the CPU
has them, else ``vdpbf16ps``, else (AVX2) two float32 fused multiply-adds per input pair.
oneDNN's bf16 GEMM keeps a row's bits across row counts on some CPUs (up to 32 rows with AMX)
but not on others (AVX512-BF16 without AMX: a down projection's rows change from 4 rows per
call on), so exactness cannot rest on it. Without the C++ kernels, invariant bf16 linears fall
back to packed oneDNN calls of at most ``INVARIANT_TILE_ROWS`` rows, which holds on AMX CPUs
only, and float32 linears to ``F.linear``.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from specdec.kernels import cpu_ops

INVARIANT_TILE_ROWS = 32  # most rows per bf16 oneDNN call for which every row's bits are fixed


def can_prepack(dtype: torch.dtype) -> bool:
    """Whether this build of torch, on this CPU, can pack ``dtype`` weights for oneDNN (bf16
    only): oneDNN's bf16 linears need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and refuse to
    pack on a CPU with AVX2 alone."""
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and _onednn_bf16_cpu()
    )


def onednn_keeps_rows() -> bool:
    """Whether oneDNN's bf16 GEMM keeps each row's bits across calls of up to
    ``INVARIANT_TILE_ROWS`` rows here, as the fallback without the C++ kernels needs: on AMX
    CPUs. On an AVX-512 CPU without AMX or BF16 a 576 -> 960 linear's rows changed with the row
    count, as did the rows of oneDNN's bf16 attention matmuls."""
    return can_prepack(torch.bfloat16) and "amx_bf16" in cpu_ops.cpu_flags().split()


def can_batch_invariant(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` linears and attention can run batch-invariant here: float32 and bf16 on
    the C++ kernels (any x86-64 CPU they build for), or bf16 on oneDNN's packed weights where it
    keeps rows' bits (:func:`onednn_keeps_rows`)."""
    if dtype == torch.float32:
        return cpu_ops.enabled()
    return dtype == torch.bfloat16 and (cpu_ops.enabled() or onednn_keeps_rows())


def batch_invariant_by_default(dtype: torch.dtype) -> bool:
    """Whether ``batch_invariant=None`` turns invariance on: where the kernels run at vector
    speed, on a CPU with AVX-512 or with AVX2 and FMA. Without them the row kernels are scalar
    loops (a bf16 prefill of the default model took minutes), so invariance is there only when
    asked for, and float32 runs on MKL.

    On an AVX2 CPU (2 cores, default model, one process), invariant bf16 against oneDNN-less
    ``F.linear`` (what bf16 ran on there before): a decode step 20.9 -> 14.2 ms, a 9-token
    verification 140 -> 29 ms, a 512-token prompt 6.2 -> 1.8 s (float32: 25.3 ms, 48 ms,
    1.05 s). Float32 costs nothing to make invariant once its linears are packed in lanes:
    against the same engine with ``batch_invariant=False`` (attention to prompt chunks then
    through torch's SDPA), prompts of 9-512 tokens ran 1.03-1.20x, of 1,500 tokens 0.95x, and 4
    long summarization and retrieval prompts with 64 new tokens each 1.00x."""
    return can_batch_invariant(dtype) and vector_row_kernels()


def vector_row_kernels() -> bool:
    """Whether the row kernels (``linear_pairs``, ``linear_lanes``) are built with vector code
    here: AVX-512, or AVX2 with FMA; otherwise they are scalar loops."""
    flags = set(cpu_ops.cpu_flags().split())
    return cpu_ops.enabled() and ("avx512f" in flags or {"avx2", "fma"} <= flags)


@functools.cache
def _onednn_bf16_cpu() -> bool:
    flags = set(cpu_ops.cpu_flags().split())
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's packed layout; inference only."""

    def __init__(self, linear: nn.Linear, max_rows: int | None = None):
        super().__init__()
        self.max_rows = max_rows  # rows per kernel call; None: the whole input in one call
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.weight_nbytes = weight.numel() * weight.element_size()
        # An opaque oneDNN tensor, kept as a plain attribute: it is not a parameter to save.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        if self.max_rows is None or x.shape[0] <= self.max_rows:
            return self._matmul(x)
        return torch.cat([self._matmul(t) for t in x.split(self.max_rows)])

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def prepack_linears(model: nn.Module, invariant: bool = False) -> int:
    """Replace every bf16 ``nn.Linear`` in ``model`` by a :class:`PackedLinear`; return how many.

    A tied output layer gets a packed copy of the embedding matrix (the embedding keeps its own
    rows for lookups). Does nothing where :func:`can_prepack` is false. ``invariant``: the packed
    linears run in row tiles that keep every row's result independent of the batch.
    """
    max_rows = INVARIANT_TILE_ROWS if invariant else None
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and can_prepack(child.weight.dtype)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, max_rows))
    return len(swaps)


def fast_linears(module: nn.Module) -> nn.Module:
    """Run ``module``'s CPU linears on the target's kernels, for a drafter's few-row steps (its
    drafts change speed, never output): float32 on the lane kernel; bfloat16 packed in pairs for
    the row kernel where that runs at vector speed (AVX-512, or AVX2 with FMA), else on
    oneDNN-packed weights. At a drafter's shapes the row kernels took about half the time of the
    alternative for one row (``F.linear`` in float32, oneDNN in bfloat16), and oneDNN won in
    bfloat16 only from about 32 rows on, a head's catch-up on a prompt. Leaves a module on
    another device as it is; returns it."""
    if all(p.device.type == "cpu" for p in module.parameters()):
        use_row_kernels(module, invariant=batch_invariant_by_default(torch.bfloat16))
        prepack_linears(module)
    return module


class RowLinear(nn.Module):
    """An ``nn.Linear`` whose weight is packed once for the row-invariant C++ kernels, which then
    run every row count: float32 in the lane layout (``pack_lanes``, ``linear_lanes``), bfloat16
    in the pair layout (``pack_pairs``: what AMX tiles and ``vdpbf16ps`` read). The plain matrix
    is let go, so that the model does not hold two copies; a tied output layer gets a packed copy
    of the embedding matrix (the embedding keeps its rows for lookups)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        kernels = cpu_ops.extension()
        if kernels is None:
            raise RuntimeError("RowLinear needs the C++ kernels (see specdec.kernels.cpu_ops)")
        weight = linear.weight.detach().contiguous()
        if weight.dtype == torch.float32:
            self.layout, packed = "lanes", kernels.pack_lanes(weight)
        elif weight.dtype == torch.bfloat16:
            self.layout, packed = "pairs", kernels.pack_pairs(weight)
        else:
            raise ValueError(f"RowLinear takes float32 or bfloat16 weights, not {weight.dtype}")
        self.packed = nn.Parameter(packed, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        kernels = cpu_ops.extension()
        assert kernels is not None  # it packed the weight
        if self.layout == "lanes":
            return kernels.linear_lanes(x.contiguous(), self.packed, self.bias, self.out_features)
        return kernels.linear_pairs(x.contiguous(), self.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"packed in {self.layout}"
        )


def use_row_kernels(model: nn.Module, invariant: bool = False) -> int:
    """Replace linears by :class:`RowLinear`s where the C++ kernels are built; return how many.

    Float32 linears where the lane kernel is vector code (AVX-512, or AVX2 with FMA: it was at
    least as fast as MKL at every row count, see the module docstring) or with ``invariant``.
    Bfloat16 linears with ``invariant``, so that no row depends on
    the batch, and without it where oneDNN packs no bf16 weights but the pair kernel is vector
    code (AVX2 CPUs): ``F.linear``, the alternative there, was slower at every row count (on 2
    AVX2 cores, default model: a 9-token verification 140 against 29 ms, a 512-token prompt 6.2
    against 1.8 s).
    """
    if not cpu_ops.enabled():
        return 0
    lanes = invariant or vector_row_kernels()  # else F.linear: MKL beats a scalar loop
    pairs = invariant or (vector_row_kernels() and not can_prepack(torch.bfloat16))
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and child.weight.device.type == "cpu"
        and (
            (lanes and child.weight.dtype == torch.float32)
            or (pairs and child.weight.dtype == torch.bfloat16)
        )
    ]
    for parent, name, child in swaps:
        setattr(parent, name, RowLinear(child))
    return len(swaps)
