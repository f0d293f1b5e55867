"""The CPU attention kernels against the torch path, in ``specdec bench --modes kernels``.

For the default model's head geometry (9 query heads, 3 KV heads, head dim 64), batch-invariant
mode, in bfloat16 and float32: ``paged_attention`` with the fused kernel (``kernels/cpu_ops.cpp``;
bf16 on AMX tiles, ``kernels/cpu_attention.cpp``, where the CPU has them) against the same call
on the torch path that a machine without the kernels runs (keys gathered, then matmuls whose
per-row reduction order does not depend on the batch), on the same metadata and one layer's
paged cache, blocks out of order as a long-running pool leaves them. Shapes: a prompt chunk of
930 tokens, a 9-row verification at 500 keys, a decode at 300 and at 2,000 keys, and 32 decodes
at 300 keys. The two run side by side in one process, each figure the best of ``repeats``.

The rate is the attention's multiply-adds, two per query, key seen and dim for the scores and
again for the weighted values, over the kernel's time (K/V writes included in the time).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES: list[tuple[str, int, int, int]] = [  # name, sequences, query rows each, keys each
    ("decode at 300 keys", 1, 1, 300),
    ("verification, 9 rows at 500 keys", 1, 9, 500),
    ("prompt chunk of 930 tokens", 1, 930, 930),
    ("decode at 2,000 keys", 1, 1, 2000),
    ("32 decodes at 300 keys", 32, 1, 300),
]


def run_attention(repeats: int = 5, quick: bool = False) -> dict[str, Any]:
    """Time the fused kernel and the torch path at each shape, in bf16 and float32."""
    from specdec.kernels import cpu_ops

    if cpu_ops.extension() is None:
        return {"skipped": "the fused CPU kernels are not built (see SPECDEC_CPU_KERNELS)"}
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, seqs, q_len, context in SHAPES[: 2 if quick else None]:
            call = _call(seqs, q_len, context, dtype)
            fused = _best(call, repeats)
            extension_for = cpu_ops.extension_for
            cpu_ops.extension_for = lambda t: None  # type: ignore[assignment]
            try:
                reference = _best(call, repeats)
            finally:
                cpu_ops.extension_for = extension_for  # type: ignore[assignment]
            seen = seqs * sum(context - q_len + j + 1 for j in range(q_len))  # causal (query, key)
            rows.append(
                {
                    "shape": name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "kernel_ms": round(fused * 1e3, 4),
                    "torch_ms": round(reference * 1e3, 4),
                    "speedup": round(reference / fused, 3),
                    "kernel_gflop_s": round(4 * seen * HEADS * HEAD_DIM / fused / 1e9, 2),
                }
            )
    return {"heads": [HEADS, KV_HEADS, HEAD_DIM], "rows": rows}


def _call(seqs: int, q_len: int, context: int, dtype: torch.dtype) -> Callable[[], object]:
    """``paged_attention`` for ``seqs`` sequences of ``context`` keys, the last ``q_len`` of
    each this step's queries."""
    from specdec.attention import AttentionMetadata, paged_attention

    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    order = torch.randperm(seqs * per_seq, generator=gen)  # blocks out of order
    tables = [order[i * per_seq : (i + 1) * per_seq].tolist() for i in range(seqs)]
    shape = (seqs * per_seq, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in "kv")
    q = torch.randn(seqs * q_len, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(seqs * q_len, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in "kv")
    positions = range(context - q_len, context)
    slots = torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for t in tables for p in positions])
    meta = AttentionMetadata.build(
        [q_len] * seqs, [context] * seqs, tables, slots, BLOCK, invariant=True
    )
    return lambda: paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    return best


def markdown(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"Not run: {result['skipped']}.\n"
    heads, kv_heads, head_dim = result["heads"]
    lines = [
        f"`paged_attention`, batch-invariant mode, {heads} query heads, {kv_heads} KV heads, "
        f"head dim {head_dim}: the fused kernel against the torch path, side by side.",
        "",
        "| shape | dtype | kernel | torch | speedup | kernel rate |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['kernel_ms']:.3f} ms | {r['torch_ms']:.3f} ms "
            f"| {r['speedup']:.2f}x | {r['kernel_gflop_s']:.1f} GFLOP/s |"
        )
    return "\n".join(lines) + "\n"
