"""The sampler's race noise on the device: a Triton kernel of :func:`specdec.kernels.cpu_ops.exponential_noise`.

Row ``i`` of the output is ``V`` Exp(1) values that are a function of the 64-bit key ``keys[i]``
alone (counter-based SplitMix64, defined in :func:`specdec.kernels.cpu_ops.exponential_noise`).
The uniforms are computed exactly as there, in unsigned 64-bit arithmetic; ``E = -log(u)`` is
taken in float64 and rounded to float32, as :func:`specdec.kernels.cpu_ops.exponential_noise_reference`
does. The CPU's compiled kernel uses a float32 log within one ulp of that, so a key gets the same
noise on every device up to one ulp of a value.

Drawing on the device matters for verification on CUDA: a step that verifies ``B`` sequences of
``k`` drafts needs ``(k + 1) B`` rows of ``V`` values (113 MB for B = 64, k = 8, V = 49,152),
which the CPU would compute in tens of milliseconds and then copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from specdec.kernels.cpu_ops import GOLDEN_GAMMA, MIX_MULTIPLIERS
from specdec.kernels.launch_checks import check_tensors

BLOCK = 1024  # tokens per program


@triton.jit
def _exponential_noise_kernel(
    out_ptr,  # [N, V] float32
    keys_ptr,  # [N] int64, each a 64-bit key's bits
    vocab_size,
    GAMMA: tl.constexpr,
    MIX1: tl.constexpr,
    MIX2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] token ids
    in_vocab = offs < vocab_size
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    z = key + (offs + 1).to(tl.uint64) * GAMMA  # wraps mod 2**64
    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    index = (z ^ (z >> 31)) >> 40  # the top 24 bits
    u = (2 * index + 1).to(tl.float64) * 2.0**-25  # (index + 0.5) / 2**24, exact
    noise = (-tl.log(u)).to(tl.float32)
    tl.store(out_ptr + row * vocab_size + offs, noise, mask=in_vocab)


def exponential_noise_triton(
    keys: torch.Tensor,  # [N] int64 on the device
    vocab: int,
) -> torch.Tensor:  # [N, V] float32 Exp(1) noise
    """Launch the kernel: a program per row and ``BLOCK`` tokens. CUDA tensors run it compiled;
    CPU tensors need Triton's interpreter (``TRITON_INTERPRET=1``), for tests."""
    check_tensors({"keys": (keys, (keys.numel(),), (torch.int64,))}, "keys")
    interpreted = isinstance(_exponential_noise_kernel, InterpretedFunction)
    if keys.device.type != "cuda" and not interpreted:
        raise RuntimeError(
            "the Triton noise kernel needs CUDA tensors, or TRITON_INTERPRET=1 set before triton "
            "is first imported to run on CPU"
        )
    out = torch.empty(keys.numel(), vocab, dtype=torch.float32, device=keys.device)
    if keys.numel() and vocab:
        grid = (keys.numel(), triton.cdiv(vocab, BLOCK))
        _exponential_noise_kernel[grid](
            out, keys, vocab,
            GAMMA=GOLDEN_GAMMA, MIX1=MIX_MULTIPLIERS[0], MIX2=MIX_MULTIPLIERS[1], BLOCK=BLOCK,
        )  # fmt: skip
    return out
