"""Runtime mode: the engine's own speed against transformers, without speculation.

    specdec bench --modes runtime [--dtype float32] [--quick]

For each dtype it reports, as ratios measured in this one process:

* single-stream greedy decode tokens/s, specdec vs ``transformers`` ``generate``;
* throughput of the 32 requests of ``eval/prompts/runtime.jsonl`` (varied prompt and output
  lengths, all submitted at once), specdec vs ``transformers`` static batching (padded to the
  longest prompt, run to the longest output) and vs its continuous batching (``generate_batch``'s
  manager, with each request's own output length);
* the fraction of the memory-bandwidth limit reached in single-stream decode: weight bytes read
  per step over time per step, against a streaming read measured the same way in this run.

Every system produces exactly the same useful tokens (EOS ignored), and throughput counts only
those. The fused CPU kernels are built and every system generates once before anything is timed,
so no one-time cost (a build, an import, a first call) enters a figure. bfloat16 runs on
batch-invariant kernels, the engine's default there (exact speculation, see
``specdec/attention.py``); ``--no-batch-invariant`` measures the faster kernels without that
guarantee.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from specdec import LLM, SamplingParams
from specdec.eval.prompts import conversation, load_prompts
from specdec.kernels import cpu_ops
from specdec.models.hugepages import huge_page_buffer, huge_pages_available


def stream_read_gbps(num_bytes: int = 2**30, repeats: int = 5) -> float:
    """Best streaming-read rate (GB/s) of a large float32 tensor summed by torch, from ordinary
    pages and from huge pages (where the engine keeps its weights) alike: the higher counts."""
    tensors = [torch.ones(num_bytes // 4)]
    if huge_pages_available():
        tensors.append(huge_page_buffer(num_bytes).view(torch.float32).fill_(1.0))
    best = float("inf")
    for x in tensors:
        x.sum()
        best = min(best, *(_timed(x.sum) for _ in range(repeats)))
    return num_bytes / best / 1e9


def weight_bytes_per_step(llm: LLM) -> int:
    """Bytes of weights one decode step reads: every matrix once (an untied embedding: one row)."""
    return llm.engine.runner.model.weight_bytes_per_step()


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(_timed(fn) for _ in range(repeats))


def single_stream(llm: LLM, hf, prompt: list[int], num_tokens: int, repeats: int) -> dict:  # noqa: ANN001
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    ids = torch.tensor([prompt])

    def ours() -> None:
        llm.generate([prompt], params)

    def theirs() -> None:
        hf.generate(
            ids,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=0,
        )

    ours()  # warm up both
    theirs()
    t_ours, t_hf = [], []
    for _ in range(repeats):  # interleaved, so drift in machine load hits both alike
        t_ours.append(_timed(ours))
        t_hf.append(_timed(theirs))
    out = llm.generate([prompt], params)[0]
    m = out.metrics
    assert m.first_token_time is not None and m.finish_time is not None
    step_time = (m.finish_time - m.first_token_time) / max(1, num_tokens - 1)
    return {
        "specdec_tok_s": num_tokens / statistics.median(t_ours),
        "hf_generate_tok_s": num_tokens / statistics.median(t_hf),
        "speedup_vs_hf_generate": statistics.median(t_hf) / statistics.median(t_ours),
        "decode_step_ms": step_time * 1e3,
    }


def batched(llm: LLM, hf, tokenizer, requests: list[tuple[list[int], int]], repeats: int) -> dict:  # noqa: ANN001
    useful = sum(n for _, n in requests)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]

    def ours() -> None:
        llm.generate([p for p, _ in requests], params)

    def static(mix: list[tuple[list[int], int]]) -> None:
        longest = max(len(p) for p, _ in mix)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (longest - len(p)) + p for p, _ in mix])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in mix])
        most = max(n for _, n in mix)
        hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=most,
            min_new_tokens=most,
            do_sample=False,
            pad_token_id=pad,
        )

    def continuous(mix: list[tuple[list[int], int]]) -> None:
        from transformers import GenerationConfig

        config = GenerationConfig(
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            max_new_tokens=max(n for _, n in mix),
        )
        with hf.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=5
        ) as manager:
            ids = [manager.add_request(p, max_new_tokens=n) for p, n in mix]
            done: set[str] = set()
            while len(done) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    done.add(result.request_id)

    # Warm up, untimed: specdec on the whole mix, and
    # transformers, which allocates anew at every call, on two short requests.
    warm_up = [(p, 4) for p, _ in requests[:2]]
    ours()
    static(warm_up)
    continuous(warm_up)
    t: dict[str, list[float]] = {"specdec": [], "hf_static": [], "hf_continuous": []}
    for _ in range(repeats):
        t["specdec"].append(_timed(ours))
        t["hf_static"].append(_timed(lambda: static(requests)))
        t["hf_continuous"].append(_timed(lambda: continuous(requests)))
    med = {k: statistics.median(v) for k, v in t.items()}
    prompt_tokens = [len(p) for p, _ in requests]
    return {
        "num_requests": len(requests),
        "useful_tokens": useful,
        "prompt_tokens_min": min(prompt_tokens),
        "prompt_tokens_median": statistics.median(prompt_tokens),
        "prompt_tokens_max": max(prompt_tokens),
        **{f"{k}_tok_s": useful / v for k, v in med.items()},
        "speedup_vs_hf_static": med["hf_static"] / med["specdec"],
        "speedup_vs_hf_continuous": med["hf_continuous"] / med["specdec"],
    }


def run_dtype(dtype: str, quick: bool, batch_invariant: bool | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    from specdec.loader import default_model_dir

    kernels = cpu_ops.extension() is not None  # built (or loaded) here, before anything is timed
    # No prefix caching: every timed run of the mix recomputes its prompts, as transformers does.
    llm = LLM(dtype=dtype, batch_invariant=batch_invariant, enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=llm.dtype).eval()
    records = load_prompts("runtime")[: 8 if quick else None]
    requests = [
        (llm.apply_chat_template(conversation(r)), r["max_tokens"] // (4 if quick else 1))
        for r in records
    ]
    print(f"[{dtype}] single stream ...", flush=True)
    with torch.inference_mode():
        single = single_stream(llm, hf, requests[3][0], 32 if quick else 128, 1 if quick else 3)
        print(f"[{dtype}] {len(requests)} concurrent requests ...", flush=True)
        batch = batched(llm, hf, llm.tokenizer, requests, 1)
    read = stream_read_gbps()
    weights = weight_bytes_per_step(llm)
    single["weight_bytes_per_step"] = weights
    single["stream_read_gb_s"] = read
    single["bandwidth_fraction"] = weights / (single["decode_step_ms"] / 1e3) / 1e9 / read
    invariant = llm.engine.runner.model.batch_invariant
    return {
        "dtype": dtype,
        "batch_invariant": invariant,
        "cpu_kernels": kernels,
        "single_stream": single,
        "batched": batch,
    }


def markdown(results: list[dict]) -> str:
    mix = results[0]["batched"]
    lines = [
        "| dtype | single-stream tok/s (specdec / HF) | speedup | bandwidth used | "
        f"{mix['num_requests']}-req tok/s specdec | vs HF static | vs HF continuous |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s, b = r["single_stream"], r["batched"]
        kernels = "" if r.get("cpu_kernels", True) else " (no CPU kernels)"
        lines.append(
            f"| {r['dtype']}{' (batch-invariant)' if r.get('batch_invariant') else ''}{kernels} | "
            f"{s['specdec_tok_s']:.1f} / {s['hf_generate_tok_s']:.1f} | "
            f"{s['speedup_vs_hf_generate']:.2f}x | {s['bandwidth_fraction']:.0%} of "
            f"{s['stream_read_gb_s']:.1f} GB/s | {b['specdec_tok_s']:.1f} | "
            f"{b['speedup_vs_hf_static']:.2f}x | {b['speedup_vs_hf_continuous']:.2f}x |"
        )
    lines.append(
        f"\nThe {mix['num_requests']} requests: prompts of {mix['prompt_tokens_min']} to "
        f"{mix['prompt_tokens_max']} tokens (median {mix['prompt_tokens_median']:g}), "
        f"{mix['useful_tokens']} output tokens in all."
    )
    return "\n".join(lines) + "\n"
