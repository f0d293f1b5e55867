"""Micro-benchmark of verification: the fused Triton kernel against the torch reference.

    python -m specdec.eval.bench_rejection [--batch 64] [--k 8] [--vocab 49152] [--interpret]

On CUDA both implementations run. On CPU only the torch reference is timed, unless --interpret
runs the kernel in Triton's interpreter too (exact, but its speed says nothing about the GPU).

Bandwidth: the bytes of the rows verification must read (one vocabulary pass per random sequence
over p, the race noise, and q if a draft was rejected; one pass over p per greedy position
visited; the accept tests read scalars), divided by each implementation's time, as a fraction of
a streaming read (``target_probs.sum()``) timed in the same run.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="sequences B")
    parser.add_argument("--k", type=int, default=8, help="drafts per sequence")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size V")
    parser.add_argument("--greedy-fraction", type=float, default=0.0, help="share of greedy rows")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls (median reported)")
    parser.add_argument("--interpret", action="store_true", help="on CPU, also time the kernel")
    return parser.parse_args()


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


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = ["torch", "triton"] if device.type == "cuda" or args.interpret else ["torch"]
    if device.type != "cuda" and args.interpret and os.environ.get("TRITON_INTERPRET") != "1":
        # The interpreter is chosen when triton is first imported, and importing specdec does.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]], env)
    from specdec.verify import VerifyOutput, draw_uniforms, rejection_sample

    torch.manual_seed(0)
    inputs = make_inputs(args.batch, args.k, args.vocab, args.greedy_fraction, device)
    uniforms = draw_uniforms(inputs[1], inputs[4], args.vocab)

    def verify(backend: str) -> VerifyOutput:  # the same inputs and randomness for every backend
        return rejection_sample(*inputs, uniforms=uniforms, backend=backend)

    num_accepted = verify("torch").num_accepted
    read = rows_read(inputs, num_accepted)
    stream = time_call(lambda: inputs[3].sum(), args.repeats, device)
    stream_rate = inputs[3].numel() * inputs[3].element_size() / stream
    print(f"verify B={args.batch} k={args.k} V={args.vocab} float32 on {device}")
    print(f"drafts accepted per sequence: {num_accepted.float().mean():.2f} of {args.k}")
    print(f"bytes of the rows verification must read: {read / 1e6:.1f} MB")
    print(f"streaming read (target_probs.sum()): {stream_rate / 1e9:.1f} GB/s")
    seconds = {}
    for backend in backends:
        repeats = args.repeats if backend == "torch" or device.type == "cuda" else 2
        seconds[backend] = time_call(functools.partial(verify, backend), repeats, device)
        rate = read / seconds[backend]
        print(
            f"{NAMES[backend]:>16}: {seconds[backend] * 1e3:9.3f} ms, "
            f"{rate / 1e9:6.1f} GB/s = {rate / stream_rate:6.1%} of streaming"
        )
    if "triton" in seconds:
        print(f"time ratio kernel / reference: {seconds['triton'] / seconds['torch']:.3f}")


NAMES = {"torch": "torch reference", "triton": "triton kernel"}

if __name__ == "__main__":
    main()
