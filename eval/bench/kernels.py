"""The verification kernel's micro-benchmark: the fused Triton kernel against the torch reference.

``specdec bench --modes kernels [--kernel-batch 64 --kernel-k 8 --kernel-vocab 49152]``. On CUDA
both implementations run. On CPU only the torch reference is timed, unless Triton's interpreter
was chosen (``TRITON_INTERPRET=1`` in the environment): then the kernel is timed too (exact, but
its speed says nothing about a GPU).

Bandwidth: the bytes of the rows verification must read (one vocabulary pass per random sequence
over p, the race noise, and q if a draft was rejected; one pass over p per greedy position
visited; the accept tests read scalars), divided by each implementation's time, as a fraction of
a streaming read (``target_probs.sum()``) timed in the same run.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_inputs(
    batch: int, k: int, vocab: int, greedy_fraction: float, device: torch.device
) -> Inputs:  # draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, is_greedy
    """Drafts sampled from a draft distribution close to the target, as a good drafter's are."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch * (k + 1), vocab, generator=gen) * 3  # [T + B, V]
    target_probs = torch.softmax(logits, dim=-1)
    draft_rows = (torch.arange(batch * (k + 1)) % (k + 1)) < k  # [T + B] rows with a draft
    noise = 0.5 * torch.randn(batch * k, vocab, generator=gen)
    draft_probs = torch.softmax(logits[draft_rows] + noise, dim=-1)  # [T, V]
    drafts = torch.multinomial(draft_probs, 1, generator=gen).squeeze(1)  # [T]
    cu = torch.arange(1, batch + 1) * k  # [B]
    is_greedy = torch.rand(batch, generator=gen) < greedy_fraction  # [B]
    return (
        drafts.to(device),
        cu.to(device),
        draft_probs.to(device),
        target_probs.to(device),
        is_greedy.to(device),
    )


def time_call(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median seconds per call, after one warm-up call (which also compiles the kernel)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rows_read(inputs: Inputs, num_accepted: torch.Tensor) -> int:
    """Bytes of the probability and noise rows a verification must read (the kernel reads these)."""
    drafts, cu, draft_probs, target_probs, is_greedy = inputs
    k = torch.diff(cu, prepend=cu.new_zeros(1))  # [B]
    row_p = target_probs.shape[1] * target_probs.element_size()  # bytes of one row of p
    row_q = draft_probs.shape[1] * draft_probs.element_size()
    row_noise = target_probs.shape[1] * 8
    greedy_passes = int((num_accepted + 1)[is_greedy].clamp(max=k[is_greedy] + 1).sum())
    rejected = int(((num_accepted < k) & ~is_greedy).sum())
    random_rows = int((~is_greedy).sum())
    return greedy_passes * row_p + random_rows * (row_p + row_noise) + rejected * row_q


def run_kernels(
    batch: int = 64, k: int = 8, vocab: int = 49152, greedy_fraction: float = 0.0, repeats: int = 20
) -> dict[str, Any]:
    """Time verification of ``batch`` sequences with ``k`` drafts each over ``vocab`` tokens."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    backends = ["torch", "triton"] if device.type == "cuda" or interpret else ["torch"]
    from specdec.verify import VerifyOutput, draw_uniforms, rejection_sample

    torch.manual_seed(0)
    inputs = make_inputs(batch, k, vocab, greedy_fraction, device)
    uniforms = draw_uniforms(inputs[1], inputs[4], vocab)

    def verify(backend: str) -> VerifyOutput:  # the same inputs and randomness for every backend
        return rejection_sample(*inputs, uniforms=uniforms, backend=backend)

    num_accepted = verify("torch").num_accepted
    read = rows_read(inputs, num_accepted)
    stream = time_call(lambda: inputs[3].sum(), repeats, device)
    stream_rate = inputs[3].numel() * inputs[3].element_size() / stream
    result: dict[str, Any] = {
        "batch": batch,
        "k": k,
        "vocab": vocab,
        "device": device.type,
        "mean_accepted": round(float(num_accepted.float().mean()), 3),
        "bytes_read": read,
        "stream_read_gb_s": round(stream_rate / 1e9, 2),
    }
    for backend in backends:
        runs = repeats if backend == "torch" or device.type == "cuda" else 2
        seconds = time_call(functools.partial(verify, backend), runs, device)
        result[f"{backend}_ms"] = round(seconds * 1e3, 4)
        result[f"{backend}_fraction_of_stream"] = round(read / seconds / stream_rate, 4)
    if "triton_ms" in result:
        result["triton_vs_torch"] = round(result["triton_ms"] / result["torch_ms"], 4)
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Verification of B={result['batch']} sequences, k={result['k']}, V={result['vocab']} "
        f"(float32, {result['device']}): {result['bytes_read'] / 1e6:.1f} MB of rows to read, "
        f"streaming read {result['stream_read_gb_s']:.1f} GB/s, "
        f"{result['mean_accepted']:.2f} drafts accepted per sequence.",
        "",
    ]
    for backend in ("torch", "triton"):
        if f"{backend}_ms" in result:
            lines.append(
                f"- {NAMES[backend]}: {result[f'{backend}_ms']:.3f} ms, "
                f"{result[f'{backend}_fraction_of_stream']:.1%} of streaming"
            )
    if "triton_ms" not in result:
        lines.append("- triton kernel: not timed (no CUDA; set TRITON_INTERPRET=1 to interpret it)")
    return "\n".join(lines) + "\n"


NAMES = {"torch": "torch reference", "triton": "triton kernel"}
