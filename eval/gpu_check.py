"""``make gpu-check``: the engine on a CUDA GPU, side by side with transformers, in one summary.

Run after the tests marked ``cuda`` (see the Makefile). Everything is measured in this one
process, on the default model, greedy, prompt processing included:

* single-stream decode: the engine without speculation, with prompt lookup, and transformers
  ``generate`` on the same GPU and prompts (two questions per category of the shipped set);
* 32 concurrent requests: the engine's throughput against one stream's;
* float32 exactness: greedy output with prompt lookup against plain decoding, in one batch;
* CUDA graphs (``cuda_graphs=True``): single stream with and without prompt lookup, and 32
  concurrent requests, against the same engine run eagerly; in float32, greedy output with
  graphs against plain eager decoding;
* drafters with a model of their own, not yet checked on a GPU (EAGLE and Medusa, the shipped
  heads): float32 greedy output against plain decoding, and single-stream speed against it;
* the verification kernel (row-token mode, as the engine calls it, and the ratio-test mode) for
  B = 64 sequences of k = 8 drafts over V = 49,152 tokens: its time against the bytes it must
  read, as a share of the device's copy bandwidth measured on the spot.

Greedy outputs of the engine with and without prompt lookup are compared token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from specdec import LLM, SamplingParams, SpecConfig
from specdec.drafters.registry import UNCHECKED_CUDA_ENV
from specdec.eval.questions import by_category, read_questions
from specdec.kernels.rejection import rejection_sample_triton, verify_row_tokens_triton
from specdec.loader import default_model_dir

LOOKUP = SpecConfig("prompt_lookup", num_speculative_tokens=8, adaptive=False)
KV_BLOCKS = 4096  # per engine: 32 requests of the longest prompt and 128 new tokens fit


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", default=None, help="Also write the figures to this file.")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu-check needs a CUDA GPU and a CUDA build of torch")
    questions = [q for qs in by_category(read_questions(), args.per_category).values() for q in qs]
    chats = [q.conversation() for q in questions]
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "prompts": len(chats),
    }
    # Each engine gets a pool of its own size: sized from free memory, the first would leave the
    # second nothing.
    plain = LLM(dtype=args.dtype, device="cuda", num_kv_blocks=KV_BLOCKS)
    lookup = LLM(dtype=args.dtype, device="cuda", num_kv_blocks=KV_BLOCKS, speculative=LOOKUP)
    prompts = [plain.apply_chat_template(c) for c in chats]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("single_stream", lambda: _single_stream(plain, lookup, prompts, params, args)),
        ("concurrent_32", lambda: _concurrent(plain, prompts, params, summary)),
        ("float32_exactness", lambda: _float32_exactness(prompts[:4])),
        ("cuda_graphs", lambda: _cuda_graphs(prompts, params, summary, args)),
        ("heads", lambda: _heads(prompts[:6])),
        ("verification_kernel", _kernel_figures),
    ]
    failed = False
    for name, section in sections:  # a failing section is reported, and the others still run
        start = time.perf_counter()
        try:
            summary[name] = section()
        except Exception as error:  # noqa: BLE001 - the summary names it; the exit status too
            failed = True
            summary[name] = {"error": f"{type(error).__name__}: {error}"}
        summary[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(name, json.dumps(summary[name]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    if failed:
        raise SystemExit("gpu-check: a section failed (see its error above)")
    return summary


def _single_stream(
    plain: LLM, lookup: LLM, prompts: list[list[int]], params: SamplingParams, args: Any
) -> dict[str, Any]:
    """One request at a time: the engine, the engine with prompt lookup, transformers."""
    rates: dict[str, float] = {}
    outputs: dict[str, list[list[int]]] = {}
    for name, llm in (("specdec", plain), ("specdec + prompt lookup", lookup)):
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm up
        seconds, outputs[name] = _one_at_a_time(llm, prompts, params)
        rates[name] = sum(map(len, outputs[name])) / seconds
    rates["transformers generate"] = _transformers_rate(prompts, args)
    same = sum(a == b for a, b in zip(outputs["specdec"], outputs["specdec + prompt lookup"]))
    return {
        "tok_s": rates,
        "vs_specdec": {k: v / rates["specdec"] for k, v in rates.items()},
        # bfloat16 on CUDA is not bit-exact under speculation (see the README)
        "prompt_lookup_outputs_equal_plain": f"{same}/{len(prompts)}",
        "prompt_lookup_acceptance": lookup.engine.verifier.stats.acceptance_rate,
    }


def _concurrent(
    plain: LLM, prompts: list[list[int]], params: SamplingParams, summary: dict[str, Any]
) -> dict[str, Any]:
    """32 requests at once, against the single stream's rate."""
    batch = (prompts * 32)[:32]
    torch.cuda.synchronize()
    start = time.perf_counter()
    done = plain.generate(batch, params)
    torch.cuda.synchronize()
    rate = sum(len(o.token_ids) for o in done) / (time.perf_counter() - start)
    single = summary.get("single_stream", {}).get("tok_s", {}).get("specdec")
    return {"tok_s": rate, "vs_single_stream": rate / single if single else None}


def _float32_exactness(prompts: list[list[int]]) -> dict[str, Any]:
    """In float32, greedy output with prompt lookup must be plain decoding's, token for token."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    runs = []
    for spec in (None, LOOKUP):
        llm = LLM(dtype="float32", device="cuda", num_kv_blocks=KV_BLOCKS, speculative=spec)
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        del llm
    same = sum(a == b for a, b in zip(*runs))
    return {"batched_lookup_equals_plain": f"{same}/{len(prompts)}"}


def _cuda_graphs(
    prompts: list[list[int]], params: SamplingParams, summary: dict[str, Any], args: Any
) -> dict[str, Any]:
    """The engine replaying CUDA graphs, against its eager figures measured above."""
    eager = summary.get("single_stream", {}).get("tok_s", {})
    rates: dict[str, float] = {}
    concurrent, captured = 0.0, 0
    for name, spec in (("specdec", None), ("specdec + prompt lookup", LOOKUP)):
        llm = LLM(
            dtype=args.dtype, device="cuda", num_kv_blocks=KV_BLOCKS, speculative=spec,
            cuda_graphs=True,
        )  # fmt: skip
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm up
        seconds, outputs = _one_at_a_time(llm, prompts, params)
        rates[name] = sum(map(len, outputs)) / seconds
        if spec is None:
            concurrent = _concurrent(llm, prompts, params, {})["tok_s"]
        graphs = llm.engine.runner.graphs
        captured = len(graphs.graphs) if graphs is not None else 0
        del llm, graphs
    eager_concurrent = summary.get("concurrent_32", {}).get("tok_s")
    exact_prompts, greedy = prompts[:4], SamplingParams(temperature=0, max_tokens=64)
    runs = []
    for graphed, spec in ((False, None), (True, None), (True, LOOKUP)):
        llm = LLM(
            dtype="float32", device="cuda", num_kv_blocks=KV_BLOCKS, speculative=spec,
            cuda_graphs=graphed,
        )  # fmt: skip
        runs.append([o.token_ids for o in llm.generate(exact_prompts, greedy)])
        del llm
    return {
        "tok_s": rates,
        "vs_eager": {k: v / eager[k] for k, v in rates.items() if eager.get(k)},
        "concurrent_32_tok_s": concurrent,
        "concurrent_32_vs_eager": concurrent / eager_concurrent if eager_concurrent else None,
        "graphs_captured": captured,
        "float32_graphs_equal_eager": f"{sum(a == b for a, b in zip(runs[0], runs[1]))}/4",
        "float32_graphs_lookup_equal_eager": f"{sum(a == b for a, b in zip(runs[0], runs[2]))}/4",
    }


def _heads(prompts: list[list[int]]) -> dict[str, Any]:
    """EAGLE and Medusa on the GPU (let through for this check): in float32 their greedy output
    must be plain decoding's; single stream, against plain decoding in this process."""
    os.environ[UNCHECKED_CUDA_ENV] = "1"
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    figures: dict[str, Any] = {}
    reference: list[list[int]] = []
    seconds: dict[str, float] = {}
    for name in ("plain", "eagle", "medusa"):
        spec = None if name == "plain" else SpecConfig(name)
        llm = LLM(dtype="float32", device="cuda", num_kv_blocks=KV_BLOCKS, speculative=spec)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm up
        seconds[name], outputs = _one_at_a_time(llm, prompts, params)
        if name == "plain":
            reference = outputs
        else:
            stats = llm.engine.verifier.stats
            figures[name] = {
                "outputs_equal_plain": f"{sum(a == b for a, b in zip(outputs, reference))}/"
                f"{len(prompts)}",
                "vs_plain": seconds["plain"] / seconds[name],
                "mean_accepted_length": stats.mean_accepted_length,
            }
        del llm
    return figures


def _one_at_a_time(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, list[list[int]]]:
    outputs, seconds = [], 0.0
    for prompt in prompts:
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs.append(llm.generate([prompt], params)[0].token_ids)
        torch.cuda.synchronize()
        seconds += time.perf_counter() - start
    return seconds, outputs


def _transformers_rate(prompts: list[list[int]], args: argparse.Namespace) -> float:
    """transformers ``generate`` on the same GPU, weights and prompts: tokens/s, one at a time."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=dtype)
    model = model.to(torch.device("cuda")).eval()  # type: ignore[arg-type]
    tokens, seconds = 0, 0.0
    for i, prompt in enumerate([prompts[0], *prompts]):  # the first run warms up
        ids = torch.tensor([prompt], device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False
        )
        torch.cuda.synchronize()
        if i:
            seconds += time.perf_counter() - start
            tokens += out.shape[1] - len(prompt)
    return tokens / seconds


def _kernel_figures(batch: int = 64, k: int = 8, vocab: int = 49152) -> dict[str, float]:
    """The verification kernel on one step's rows, half the sequences greedy and half sampled,
    with every draft its row's token, so that each walk reads all its ``k + 1`` rows (the most a
    step can read): a greedy row its target row, a sampled row its target and noise rows. The
    ratio-test mode (``rejection_sample_triton``) is timed beside it on the same rows."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = batch * (k + 1)
    probs = torch.softmax(3 * torch.randn(rows, vocab, device="cuda", generator=gen), dim=-1)
    noise = torch.empty(rows, vocab, device="cuda").exponential_(generator=gen)
    is_greedy = torch.arange(batch, device="cuda") % 2 == 0
    greedy_rows = is_greedy.repeat_interleave(k + 1).unsqueeze(1)  # [rows, 1]
    row_token = torch.where(greedy_rows, probs, probs / noise).argmax(dim=1)  # [rows]
    is_draft = torch.arange(rows, device="cuda") % (k + 1) < k
    drafts = row_token[is_draft].contiguous()  # every draft accepted
    cu = torch.arange(1, batch + 1, device="cuda") * k
    row_args = (drafts, cu, probs, is_greedy, noise, k)
    tokens, accepted = verify_row_tokens_triton(*row_args)
    assert int(accepted.sum()) == batch * k, "the walks should accept every draft"
    uniforms = torch.rand(batch * k, device="cuda", dtype=torch.float64, generator=gen)
    race = noise[:batch].double()
    ratio_args = (drafts, cu, None, probs, is_greedy, uniforms, race, k)
    copy_seconds = _cuda_time(lambda: noise.clone())
    bandwidth = 2 * noise.numel() * 4 / copy_seconds  # a copy reads and writes
    row_bytes = rows * vocab * 4 * 1.5  # half the rows read probabilities and noise
    seconds = _cuda_time(lambda: verify_row_tokens_triton(*row_args))
    return {
        "batch": batch,
        "k": k,
        "vocab": vocab,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "row_tokens_us": seconds * 1e6,
        "row_tokens_bytes_mb": row_bytes / 1e6,
        "row_tokens_share_of_copy_bandwidth": row_bytes / seconds / bandwidth,
        "ratio_test_us": _cuda_time(lambda: rejection_sample_triton(*ratio_args)) * 1e6,
    }


def _cuda_time(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of ``fn`` on the GPU, by CUDA events, after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
