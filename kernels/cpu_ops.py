"""Fused CPU kernels for a decoder layer's small operations, their loader and torch references.

Single-stream decode on the CPU reads every weight once per token. That stream evicts the
working set of the Python interpreter and torch's dispatcher from the caches, so each small op
that follows a matrix product costs 5-40 us instead of its 1-2 us in a tight loop: an RMSNorm
(six torch ops inside) measured about 40 us after a linear, and a decode step of SmolLM2-135M
spent a third of its time outside its matrix products. ``cpu_ops.cpp`` does in one call what
takes torch several (the residual add and RMSNorm as vLLM's ``fused_add_rms_norm``, SiLU and
the product with ``up``, RoPE on q and k in place, the K/V write into the paged cache), and
attends decode and verification queries to keys read by slot from the cache, with no gathered
copy (scores, softmax and sums in float32; bf16 products on ``vdpbf16ps``, or on AMX tiles in
``cpu_attention.cpp`` where the CPU has them). Together they made single-stream float32 decode
about 1.2x faster. ``cpu_linear.cpp`` (bfloat16, packed in input pairs) and ``cpu_lanes.cpp``
(float32, packed in lanes of 16 features) run the model's linears
(:class:`specdec.models.linear.RowLinear`). ``cpu_sampling.cpp`` draws the sampler's noise
(:func:`exponential_noise`).

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
import sys
import warnings
from types import ModuleType

import torch
import torch.nn.functional as F

SOURCES = [
    pathlib.Path(__file__).with_name(n)
    for n in (
        "cpu_ops.cpp",
        "cpu_attention.cpp",
        "cpu_linear.cpp",
        "cpu_lanes.cpp",
        "cpu_quant.cpp",
        "cpu_sampling.cpp",
        "cpu_stack.cpp",
    )
]
HEADER = pathlib.Path(__file__).with_name("cpu_simd.h")
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment, 2**64 / the golden ratio, odd
MIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # its finaliser's (Stafford's Mix13)


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


def exponential_noise_reference(
    keys: torch.Tensor,  # [N] int64, each a 64-bit key's bits
    vocab: int,
    uniforms: bool = False,
) -> torch.Tensor:  # [N, V] float32 E, or float64 u (exact) with ``uniforms``
    """:func:`exponential_noise` in int64 torch arithmetic: multiplies and adds wrap mod 2**64
    as uint64 ones do, and a logical right shift is the arithmetic one masked to its low bits."""
    gamma, (mix1, mix2) = as_int64(GOLDEN_GAMMA), map(as_int64, MIX_MULTIPLIERS)
    counters = torch.arange(1, vocab + 1, dtype=torch.int64) * gamma  # [V] (v + 1) * gamma
    z = keys.cpu().to(torch.int64).unsqueeze(1) + counters  # [N, V]
    z = (z ^ _shift_right(z, 30)) * mix1
    z = (z ^ _shift_right(z, 27)) * mix2
    index = _shift_right(z ^ _shift_right(z, 31), 40)  # [N, V] the top 24 bits
    u = (2 * index + 1).double() * 2.0**-25  # (index + 0.5) / 2**24, exact in float64
    return u if uniforms else (-torch.log(u)).float()


def as_int64(bits: int) -> int:
    """The int64 whose two's complement bits are the 64-bit ``bits``."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """``z >> bits`` on unsigned 64-bit patterns held as int64 (torch's ``>>`` keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


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


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [N, V] float32: row i is a function of the 64-bit key ``keys[i]`` alone.

    ``keys`` [N] int64 holds each key's bits (a key ``>= 2**63`` as its negative int64). Token v of
    key s takes the v-th output of the SplitMix64 stream seeded at s (Steele, Lea and Flood 2014,
    "Fast splittable pseudorandom number generators"), keeps its top 24 bits and centres them::

        mix(z) = z ^ z >> 31 after z = (z ^ z >> 30) * M1, z = (z ^ z >> 27) * M2  (mod 2**64)
        u_v = ((mix(s + (v + 1) * GOLDEN_GAMMA mod 2**64) >> 40) + 0.5) / 2**24
        E_v = -log(u_v), rounded to float32

    with ``M1, M2 = MIX_MULTIPLIERS``, the constants of :func:`specdec.sampling.splitmix64`.
    ``u_v`` lies in [2**-25, 1 - 2**-25], strictly inside (0, 1), so ``E_v`` is finite and positive
    (at most 25 ln 2 = 17.3). The stream is counter-based, like Philox (Salmon et al. 2011,
    "Parallel random numbers: as easy as 1, 2, 3"): any token of any row is computed directly
    from (s, v), independently and identically on any device, with no generator state to carry.
    Two keys that differ by ``j * GOLDEN_GAMMA`` with ``|j| < V`` share a stretch of their
    streams, shifted; the sampler's keys are SplitMix64 outputs, so a pair does so with
    probability about ``2V / 2**64``.

    The kernel's uniforms are :func:`exponential_noise_reference`'s bit for bit. Its float32 log
    is not torch's: over all 2**24 uniforms it is within 1.4 ulp of ``-log(u_v)`` and one ulp of
    the reference (which rounds torch's float64 log), the same bits with or without AVX-512.
    """
    ext = extension()
    if ext is None:
        return exponential_noise_reference(keys, vocab)
    return ext.exponential_noise(keys.cpu().to(torch.int64), vocab)


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
    texts = [p.read_text() for p in (*SOURCES, HEADER)]
    identity = [*texts, *flags, torch.__version__, platform.machine(), cpu_flags()]
    key = hashlib.sha256("\n".join(identity).encode()).hexdigest()[:16]
    build_dir = cache_dir() / "extensions" / f"cpu_ops-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # Compile copies kept beside the build: ninja records each source's path, so two installs
    # of the same code (two virtual environments, a clone) would otherwise rebuild each time
    # the other had built. A copy is written only when missing, so its time never changes.
    sources = build_dir / "src"
    sources.mkdir(exist_ok=True)
    for path, text in zip((*SOURCES, HEADER), texts, strict=True):
        copy = sources / path.name
        if not copy.exists() or copy.read_text() != text:
            tmp = copy.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(text)
            tmp.replace(copy)  # atomic: a build started beside this one sees the whole file
    if not any(build_dir.glob(f"{name}*.so")):  # say so: the first generate would seem to hang
        print(
            f"specdec: compiling the CPU kernels once for this machine (about a minute) "
            f"into {build_dir}",
            file=sys.stderr,
            flush=True,
        )
    return cpp_extension.load(
        name=name,
        sources=[str(sources / p.name) for p in SOURCES],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )


def cpu_flags() -> str:
    """The CPU's feature flags, as /proc/cpuinfo lists them (else the processor's name)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return platform.processor()
