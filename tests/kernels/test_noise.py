"""The sampler's counter-based noise: the kernel against its torch reference and SplitMix64, rows
keyed alone, and values that pass for Exp(1) (a test that rejects a wrong transform)."""

from __future__ import annotations

import os

import pytest
import torch
from scipy.stats import kstest

from specdec.kernels import cpu_ops
from specdec.sampling import noise_seed, splitmix64
from tests.kernels import compile_for_hopper

switched_off = os.environ.get("SPECDEC_CPU_KERNELS", "1") == "0"
needs_kernels = pytest.mark.skipif(switched_off, reason="SPECDEC_CPU_KERNELS=0")
EDGE_KEYS = [0, 1, -1, 2**63 - 1, -(2**63), -987654321]


def keys(count: int, seed: int = 0) -> torch.Tensor:
    """The edge keys, then random int64 keys of both signs."""
    random = torch.randint(
        -(2**63), 2**63 - 1, (count,), generator=torch.Generator().manual_seed(seed)
    )
    return torch.cat([torch.tensor(EDGE_KEYS), random])


def ext():  # noqa: ANN201
    module = cpu_ops.extension()
    assert module is not None, "the CPU kernels did not build"
    return module


def test_the_reference_is_the_splitmix64_stream() -> None:
    """Token v's uniform is SplitMix64's v-th output, in Python's integers (no wrap-around)."""
    key = noise_seed(3, 5)
    gamma = cpu_ops.GOLDEN_GAMMA
    expected = [((splitmix64(key + v * gamma) >> 40) + 0.5) / 2**24 for v in range(40)]
    u = cpu_ops.exponential_noise_reference(torch.tensor([cpu_ops.as_int64(key)]), 40, True)
    assert u[0].tolist() == expected
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0


@needs_kernels
@pytest.mark.parametrize("vocab", [49152, 1000, 7])  # 1000 and 7: tails for the scalar code
def test_kernel_matches_the_reference(vocab: int) -> None:
    k = keys(26)
    assert torch.equal(
        ext().noise_uniforms(k, vocab), cpu_ops.exponential_noise_reference(k, vocab, True)
    )
    noise = ext().exponential_noise(k, vocab)
    assert noise.dtype == torch.float32 and noise.shape == (32, vocab)
    # torch's log against the kernel's: 1 ulp (2**-23 relative at most) and no more
    torch.testing.assert_close(
        noise, cpu_ops.exponential_noise_reference(k, vocab), rtol=3e-7, atol=0
    )


@needs_kernels
def test_rows_depend_on_their_key_alone() -> None:
    k = keys(14, seed=1)
    noise = ext().exponential_noise(k, 300)
    alone = torch.cat([ext().exponential_noise(k[i : i + 1], 300) for i in range(len(k))])
    assert torch.equal(noise, alone)
    assert torch.equal(ext().exponential_noise(k, 10_000)[:, :300], noise)  # and not on V
    assert not torch.equal(noise[0], noise[1])  # another key, another row


@needs_kernels
def test_the_scalar_and_the_vector_code_agree() -> None:
    """A row's last V % 16 tokens run the scalar code, the others 16 at a time (with AVX-512)."""
    k = keys(4000, seed=4)
    scalar, vector = ext().exponential_noise(k, 15), ext().exponential_noise(k, 16)[:, :15]
    assert torch.equal(scalar, vector)
    assert torch.equal(ext().noise_uniforms(k, 15), ext().noise_uniforms(k, 16)[:, :15])


@needs_kernels
@pytest.mark.skipif(
    " avx512f" not in cpu_ops.cpu_flags(),
    reason="this CPU has no AVX-512: the build every test here runs is the portable one",
)
def test_the_build_without_avx512_draws_the_same_noise() -> None:
    """What a CPU without AVX-512 computes (the build test_cpu_ops checks too, shared by cache).
    Compiling it takes minutes, so it is built only where it differs from the native one."""
    portable = cpu_ops._build(("-mno-avx512f",), "specdec_cpu_ops_portable")
    k = keys(10, seed=2)
    assert torch.equal(portable.exponential_noise(k, 1000), ext().exponential_noise(k, 1000))


def exponential_fit(values: torch.Tensor) -> float:
    """Kolmogorov-Smirnov p-value of ``values`` against Exp(1)."""
    return kstest(values.double().numpy(), "expon").pvalue


def test_noise_is_exponential() -> None:
    noise = cpu_ops.exponential_noise(keys(4, seed=3), 20_000).flatten()  # 200,000 values
    assert abs(float(noise.double().mean()) - 1.0) < 0.01  # 4.5 standard errors
    assert exponential_fit(noise) > 1e-3
    assert exponential_fit(noise**1.1) < 1e-6  # the check rejects a wrong transform


def test_the_reference_serves_without_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_ops, "extension", lambda: None)
    k = keys(2)
    assert torch.equal(cpu_ops.exponential_noise(k, 50), cpu_ops.exponential_noise_reference(k, 50))


@pytest.mark.cuda
def test_the_triton_kernel_draws_the_reference_noise() -> None:
    """The device's noise (specdec/kernels/noise.py; under the interpreter here) is the
    reference's bit for bit: the same uniforms, and -log taken in float64 then rounded."""
    from specdec.kernels.noise import exponential_noise_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for vocab in (1, 1000, 2049):
        drawn = exponential_noise_triton(keys(20).to(device), vocab).cpu()
        expected = cpu_ops.exponential_noise_reference(keys(20), vocab)
        if device == "cpu":
            assert torch.equal(drawn, expected)
        else:  # CUDA's float64 log may round differently: one float32 ulp at most
            torch.testing.assert_close(drawn, expected, rtol=2**-23, atol=0)
    with pytest.raises(ValueError, match="keys must have dtype"):
        exponential_noise_triton(keys(2).int().to(device), 10)


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specdec.kernels import noise

kernel = noise._exponential_noise_kernel
types = ["*fp32", "*i64", "i32", "constexpr", "constexpr", "constexpr", "constexpr"]
constexprs = {"GAMMA": noise.GOLDEN_GAMMA, "MIX1": noise.MIX_MULTIPLIERS[0],
              "MIX2": noise.MIX_MULTIPLIERS[1], "BLOCK": noise.BLOCK}
source = ASTSource(kernel, dict(zip(kernel.arg_names, types)), constexprs)
ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
print("mul.lo.s64" in ptx or "mul.lo.u64" in ptx)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the test above compiles it")
def test_the_triton_kernel_compiles_for_hopper() -> None:
    # 64-bit multiplies: the SplitMix64 stream
    assert compile_for_hopper(COMPILE_FOR_HOPPER).split() == ["True"]
