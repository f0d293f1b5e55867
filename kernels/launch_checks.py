"""What every Triton launcher in kernels/ checks before a launch, with one message per fault."""

from __future__ import annotations

import torch

Expected = dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[torch.dtype, ...]]]


def check_tensors(expected: Expected, anchor: str) -> None:
    """Raise ``ValueError`` naming the tensor unless each of ``expected`` (name -> tensor, its
    shape, its allowed dtypes) has its dtype and shape, is contiguous and lies on the device of
    the tensor named ``anchor``."""
    device = expected[anchor][0].device
    for name, (tensor, shape, dtypes) in expected.items():
        if tensor.dtype not in dtypes:
            raise ValueError(f"{name} must have dtype in {dtypes}, got {tensor.dtype}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, {anchor} on {device}")
