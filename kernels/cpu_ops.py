"""Fused CPU kernels for a decoder layer's small operations, their loader and torch references.

Single-stream decode on the CPU reads every weight once per token. That stream evicts the
working set of the Python interpreter and torch's dispatcher from the caches, so each small op
that follows a matrix product costs 5-40 us instead of its 1-2 us in a tight loop: an RMSNorm
(six torch ops inside) measured about 40 us after a linear, and a decode step of SmolLM2-135M
spent a third of its time outside its matrix products. ``cpu_ops.cpp`` does in one call what
takes torch several (the residual add and RMSNorm as vLLM's ``fused_add_rms_norm``, SiLU and
the product with ``up``, RoPE on q and k in place, the K/V write into the paged cache), and
attends decode and verification queries to keys read by slot from the cache, with no gathered
copy (scores, softmax and sums in float32). Together they made single-stream float32 decode
about 1.2x faster. Its float32 matrix-vector product serves few-row linears
(:class:`specdec.models.linear.RowLinear`).

The extension is compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler and
``ninja`` are needed) into ``$SPECDEC_CACHE/extensions``; later processes load the built
library. If it cannot be built, or ``SPECDEC_CPU_KERNELS=0`` is set, or a tensor is not a
float32/bfloat16 CPU tensor, the torch references below run instead, with a warning once.

Each row is computed alone, so results do not depend on the number of rows (batch
invariance, see :mod:`specdec.attention`). Every elementwise step rounds to the tensor's dtype
where torch's ops round (RoPE gives torch's bits in both dtypes), but the RMSNorm sum and SiLU's
``exp`` run in another order than torch's, so float32 results may differ in the last bit, and
that bit can move a bfloat16 rounding: about one RMSNorm output in 200,000 differs by one bf16
ulp. Speculative and plain decoding both run these kernels, so their outputs stay identical.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import platform
import shutil
import warnings
from types import ModuleType

import torch
import torch.nn.functional as F

SOURCE = pathlib.Path(__file__).with_name("cpu_ops.cpp")
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]


# --- references: the torch formulas, as transformers writes them --------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # the fused torch kernel computes exactly the formula below
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()  # normalise in float32 and scale in the model dtype
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    residual.add_(x)
    return rms_norm_reference(residual, weight, eps)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int
) -> None:
    rows, half = x.shape[0], head_dim // 2
    part = x[:, : heads * head_dim].view(rows, heads, head_dim)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [rows, 1, head_dim]
    rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)  # rotate_half
    part.copy_(part * c + rotated * s)


# --- the public ops -----------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` per row of ``x`` [N, H]."""
    ext = extension_for(x)
    return ext.rms_norm(x, weight, eps) if ext else rms_norm_reference(x, weight, eps)


def add_rms_norm_(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place, then return ``rms_norm(residual, weight, eps)``."""
    ext = extension_for(x)
    if ext and residual.is_contiguous() and x.is_contiguous():
        return ext.add_rms_norm_(residual, x, weight, eps)
    return add_rms_norm_reference(residual, x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for rows ``[gate | up]`` of ``gate_up`` [N, 2I]; returns [N, I]."""
    ext = extension_for(gate_up)
    if ext and gate_up.is_contiguous():
        return ext.silu_mul(gate_up)
    return silu_mul_reference(gate_up)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotate, in place, the first ``heads`` heads of each row of ``x`` [N, >= heads * D].

    ``cos`` and ``sin`` [N, D] are the row's tables in ``x``'s dtype; the rotation is
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``, as transformers.
    """
    ext = extension_for(x)
    if ext and x.stride(1) == 1:
        ext.rope_(x, cos, sin, heads, head_dim)
    else:
        rope_reference(x, cos, sin, heads, head_dim)


# --- loading ------------------------------------------------------------------------------------


def extension_for(t: torch.Tensor) -> ModuleType | None:
    """The compiled kernels if they can take ``t`` (a float32/bfloat16 CPU tensor), else None.

    Called by every layer op of a step, so it reads the cheapest properties (``is_cpu`` costs a
    third of ``device.type``)."""
    if not t.is_cpu or t.dtype not in KERNEL_DTYPES or t.requires_grad:
        return None
    return extension()


def enabled() -> bool:
    """Whether the fused kernels are in use (built or loaded, and not switched off)."""
    return extension() is not None


@functools.cache
def extension() -> ModuleType | None:
    """The compiled kernels, built on first use; ``None`` (with a warning) where unavailable."""
    if os.environ.get("SPECDEC_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        return _build()
    except Exception as exc:  # no compiler, no ninja, a failed build: fall back, loudly
        warnings.warn(
            f"specdec: the fused CPU kernels could not be built ({type(exc).__name__}: {exc}); "
            "using torch ops instead (slower; set SPECDEC_CPU_KERNELS=0 to silence this)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _build(extra_flags: tuple[str, ...] = (), name: str = "specdec_cpu_ops") -> ModuleType:
    """Compile (or load the cached build of) the kernels; ``extra_flags`` and ``name`` build a
    variant beside it (the tests build one without AVX-512, to check the portable code)."""
    from torch.utils import cpp_extension

    from specdec.loader import cache_dir

    if shutil.which("ninja") is None:  # the pip package's binary, when its bin/ is not on PATH
        import ninja  # type: ignore[import-untyped]

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    # One directory per source, flags, torch version and CPU (the build is -march=native), so an
    # upgrade or a cache shared between machines never loads a stale or foreign build.
    flags = [*FLAGS, *extra_flags]
    identity = [SOURCE.read_text(), *flags, torch.__version__, platform.machine(), _cpu_flags()]
    key = hashlib.sha256("\n".join(identity).encode()).hexdigest()[:16]
    build_dir = cache_dir() / "extensions" / f"cpu_ops-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=name,
        sources=[str(SOURCE)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return platform.processor()
