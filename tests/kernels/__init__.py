"""Tests of specdec.kernels.

Without CUDA, Triton kernels run in Triton's interpreter, which is chosen when triton is first
imported; importing this package before any kernel module selects it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
