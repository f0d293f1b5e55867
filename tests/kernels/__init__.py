"""Tests of specdec.kernels.

Without CUDA, Triton kernels run in Triton's interpreter, which is chosen when triton is first
imported; importing this package before any kernel module selects it.
"""

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def compile_for_hopper(script: str) -> str:
    """Run ``script`` (which compiles a kernel with ``triton.compile`` for ``GPUTarget("cuda",
    90, 32)``) in a fresh interpreter without ``TRITON_INTERPRET``; return what it printed.
    The interpreter accepts code the compiler rejects, and this needs no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
