"""Linear layers with their weights packed once for oneDNN, for bfloat16 on the CPU.

``F.linear`` on bfloat16 CPU tensors hands every call to oneDNN with the weight in its plain
``[out, in]`` layout, and a single-token decode step makes about 120 such calls. Packing each
weight once, into the blocked layout oneDNN's bf16 GEMM kernels read, is what PyTorch's Inductor
does when it freezes a CPU graph (``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``). On SmolLM2-135M it cut the time in the linears of a decode step by about
a third, and the time stays nearly flat from 1 to 32 query rows, so verifying drafts costs
little more than a plain step (``python -m specdec.eval.bench_runtime`` shows the step times).

Float32 keeps its plain weights: MKL's GEMV is faster at one row than the packed kernel there,
and packing for the multi-row steps would mean a second copy of every weight. Steps of at most
``SMALL_ROWS`` rows (decodes, verifications, batches of up to 64 sequences) go to the fused CPU
kernel (:class:`RowLinear`), which gives each row the same bits whatever the row count and,
with the weights on huge pages, ran the linears of a whole SmolLM2-135M step 1.15x MKL's speed
at one row, 2x at 9 rows, 1.3x at 32 and 1.14x at 64 (it repacks nothing per call, where MKL's
GEMM packs the weights it reads); larger steps (prefill chunks) go to MKL.

For batch-invariant models (see :mod:`specdec.attention`) a packed linear takes its input in
tiles of at most ``INVARIANT_TILE_ROWS`` rows: oneDNN keeps each row's bits the same for any row
count up to that, and switches to a kernel that sums in another order above it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels import cpu_ops

INVARIANT_TILE_ROWS = 32  # most rows per bf16 oneDNN call for which every row's bits are fixed
SMALL_ROWS = 64  # most rows a float32 RowLinear hands to the fused kernel; MKL is faster above


def can_prepack(dtype: torch.dtype) -> bool:
    """Whether this build of torch can pack ``dtype`` weights for oneDNN (bf16 only)."""
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


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


class RowLinear(nn.Module):
    """A float32 ``nn.Linear`` whose steps of few rows run the fused CPU matrix-vector kernel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same parameter: a tied embedding stays tied
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        kernels = cpu_ops.extension_for(x) if x.shape[0] <= SMALL_ROWS else None
        if kernels is not None and x.dtype == torch.float32 and x.is_contiguous():
            return kernels.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def use_row_kernels(model: nn.Module) -> int:
    """Replace every float32 ``nn.Linear`` in ``model`` by a :class:`RowLinear`; return how many."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32
    ]
    for parent, name, child in swaps:
        setattr(parent, name, RowLinear(child))
    return len(swaps)
