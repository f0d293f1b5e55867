"""Linear layers for the CPU: oneDNN-packed bfloat16 weights, and the row-invariant C++ kernel.

``F.linear`` on bfloat16 CPU tensors hands every call to oneDNN with the weight in its plain
``[out, in]`` layout, and a single-token decode step makes about 120 such calls. Packing each
weight once, into the blocked layout oneDNN's bf16 GEMM kernels read, is what PyTorch's Inductor
does when it freezes a CPU graph (``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``); :class:`PackedLinear` does that for bfloat16 models that need not be
batch-invariant.

:class:`RowLinear` runs the C++ kernels of ``kernels/cpu_linear.cpp``, which give each row the
same bits whatever the row count. Float32 models use them for steps of at most ``SMALL_ROWS``
rows (decodes, verifications, batches of up to 64 sequences), where they beat MKL (which repacks
the weights it reads on every call); larger float32 steps (prefill chunks) go to MKL.
Batch-invariant bfloat16 models (see :mod:`specdec.attention`) pack every weight once in input
pairs and run every row count on the kernel: AMX tiles where the CPU has them, else
``vdpbf16ps``, else (AVX2) two float32 fused multiply-adds per input pair. oneDNN's bf16 GEMM
keeps a row's bits across row counts on some CPUs (up to 32 rows with AMX) but not on others (AVX512-BF16 without AMX: a down projection's rows change from 4 rows
per call on), so exactness cannot rest on it. Without the C++ kernels, invariant bf16 linears
fall back to packed oneDNN calls of at most ``INVARIANT_TILE_ROWS`` rows, which holds on AMX CPUs
only.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels import cpu_ops

INVARIANT_TILE_ROWS = 32  # most rows per bf16 oneDNN call for which every row's bits are fixed
SMALL_ROWS = 64  # most rows a float32 RowLinear hands to the fused kernel; MKL is faster above


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


def can_batch_invariant(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` linears and attention can run batch-invariant here: bf16 on the C++
    row kernels (any x86-64 CPU they build for), or on oneDNN's packed weights."""
    return dtype == torch.bfloat16 and (cpu_ops.enabled() or can_prepack(dtype))


def batch_invariant_by_default(dtype: torch.dtype) -> bool:
    """Whether ``batch_invariant=None`` turns invariance on: where the bf16 kernels run at vector
    speed, on a CPU with AVX-512 or with AVX2 and FMA. Without them the bf16 row kernels are
    scalar loops (a prefill of the default model took minutes), so invariance is there only when
    asked for; float32 (MKL and the float32 row kernels) is the faster choice on such CPUs.

    On an AVX2 CPU (2 cores, default model, one process), invariant bf16 against oneDNN-less
    ``F.linear`` (what bf16 ran on there before): a decode step 20.9 -> 14.2 ms, a 9-token
    verification 140 -> 29 ms, a 512-token prompt 6.2 -> 1.8 s (float32: 25.3 ms, 48 ms,
    1.05 s)."""
    return can_batch_invariant(dtype) and vector_pair_kernels()


def vector_pair_kernels() -> bool:
    """Whether the bf16 pair kernel (``linear_pairs``) is built with vector code here: AVX-512,
    or AVX2 with FMA (``kernels/cpu_linear.cpp``); otherwise it is a scalar loop."""
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
    drafts change speed, never output): float32 few-row steps on the row kernel; bfloat16 packed
    in pairs for the row kernel where that runs at vector speed (AVX-512, or AVX2 with FMA),
    else on oneDNN-packed weights. At a drafter's shapes either row kernel took about half the
    time of the alternative for one row (``F.linear`` in float32, oneDNN in bfloat16), and oneDNN won in
    bfloat16 only from about 32 rows on, a head's catch-up on a prompt. Leaves a module on
    another device as it is; returns it."""
    if all(p.device.type == "cpu" for p in module.parameters()):
        use_row_kernels(module, invariant=batch_invariant_by_default(torch.bfloat16))
        prepack_linears(module)
    return module


class RowLinear(nn.Module):
    """An ``nn.Linear`` whose steps of at most ``max_rows`` rows (``None``: any number) run the
    row-invariant C++ kernel; larger steps, or a machine without the kernels, run ``F.linear``.

    ``packed``: a bfloat16 weight is packed once into the kernel's pair layout (``pack_pairs``:
    the layout AMX tiles and ``vdpbf16ps`` read) and the plain matrix is let go, so that the
    model does not hold two copies; every row count then runs the kernel.
    """

    def __init__(self, linear: nn.Linear, max_rows: int | None = SMALL_ROWS, packed: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.max_rows = None if packed else max_rows
        self.weight: nn.Parameter | None = None
        self.packed: nn.Parameter | None = None
        kernels = cpu_ops.extension() if packed else None
        if kernels is not None and linear.weight.dtype == torch.bfloat16:
            pairs = kernels.pack_pairs(linear.weight.detach().contiguous())
            self.packed = nn.Parameter(pairs, requires_grad=False)
        else:
            assert isinstance(linear.weight, nn.Parameter)
            self.weight = linear.weight  # the same parameter: a tied embedding stays tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        if self.packed is not None:
            kernels = cpu_ops.extension()
            assert kernels is not None  # it packed the weight
            return kernels.linear_pairs(x.contiguous(), self.packed, self.bias, self.out_features)
        assert self.weight is not None
        few = self.max_rows is None or x.shape[0] <= self.max_rows
        kernels = cpu_ops.extension_for(x) if few else None
        if kernels is not None and x.dtype == torch.float32 == self.weight.dtype:
            return kernels.linear(x.contiguous(), self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        rows = "any" if self.max_rows is None else f"<= {self.max_rows}"
        layout = ", packed in pairs" if self.packed is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rows {rows}{layout}"
        )


def use_row_kernels(model: nn.Module, invariant: bool = False) -> int:
    """Replace linears by :class:`RowLinear`s; return how many.

    Float32 linears take the kernel for few rows. With ``invariant`` and the C++ kernels built,
    bfloat16 linears are packed in pairs and take it for every row count, so that no row
    depends on the batch. So they do without ``invariant`` where oneDNN packs no bf16 weights
    but the pair kernel is vector code (AVX2 CPUs): ``F.linear``, the alternative there, was
    slower at every row count (on 2 AVX2 cores, default model: a 9-token verification 140
    against 29 ms, a 512-token prompt 6.2 against 1.8 s).
    """
    packed = cpu_ops.enabled() and (
        invariant or (vector_pair_kernels() and not can_prepack(torch.bfloat16))
    )
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and (
            child.weight.dtype == torch.float32 or (packed and child.weight.dtype == torch.bfloat16)
        )
    ]
    for parent, name, child in swaps:
        setattr(
            parent, name, RowLinear(child, packed=packed and child.weight.dtype == torch.bfloat16)
        )
    return len(swaps)
