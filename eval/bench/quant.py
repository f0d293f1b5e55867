"""Quant mode of ``specdec bench``: int8/int4 linears and the ``quantized_self`` drafter, side by side.

    specdec bench --modes quant [--questions-per-category N] [--max-new-tokens N] [--quick]
    python -m specdec.eval.bench.quant [--prompts-per-style N] [--max-tokens N] [--quick]

On the default model, single stream, greedy, prompt processing included, every system in this one
process taking turns prompt by prompt (so drift in the machine's speed hits all alike):

* ``float32``, ``bfloat16``: the engine unquantized;
* ``int8``, ``int4`` (float32 activations) and ``bfloat16+int4``: weight-only quantized linears
  (see :mod:`specdec.models.quant`; ``int4`` runs the GGUF file's own Q4_1 codes);
* ``w8a8``, ``w4a8`` and ``bfloat16+w4a8``: the same weights, activations rounded to int8;
* ``bfloat16+quantized_self``: a bfloat16 target verifying drafts of its own quantized copy
  (``w4a8`` by default where the CPU has VNNI or AVX2; ``int4`` and a fixed k = 4 beside it);
* ``llama.cpp``: ``llama-cpp-python`` on the same GGUF file, plain decoding, when installed (the
  ``llamacpp`` extra), fed the same token ids.

It reports tokens/s and each system's ratio to float32 and to llama.cpp, whether each engine's
output equals its own plain decoding (``quantized_self`` against ``bfloat16``), the
``quantized_self`` acceptance per draft position and mean accepted length, the weights each
decode step reads and the bound they put on every ratio (:func:`bytes_bound`), and the quality of
each quantization against float32: top-1 agreement of greedy next tokens and the mean
log-likelihood difference, teacher-forced over float32's own continuations. As a module it
writes ``eval/results/quant.{json,md}``; in ``specdec bench`` the figures join the report.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from specdec import LLM, SamplingParams
from specdec.eval.bench.systems import LlamaCpp
from specdec.eval.questions import by_category, read_questions
from specdec.kernels import cpu_ops
from specdec.verifier import SpecStats

RESULTS = Path("eval/results")
ENGINES: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
    "bfloat16+int4": {"dtype": "bfloat16", "quantization": "int4"},
    "w8a8": {"dtype": "float32", "quantization": "w8a8"},
    "w4a8": {"dtype": "float32", "quantization": "w4a8"},
    "bfloat16+w4a8": {"dtype": "bfloat16", "quantization": "w4a8"},
    "bfloat16+quantized_self": {"dtype": "bfloat16", "speculative": {"drafter": "quantized_self"}},
    "bfloat16+quantized_self int4": {
        "dtype": "bfloat16",
        "speculative": {"drafter": "quantized_self", "draft_quantization": "int4"},
    },
    "bfloat16+quantized_self k=4": {
        "dtype": "bfloat16",
        "speculative": {
            "drafter": "quantized_self",
            "num_speculative_tokens": 4,
            "adaptive": False,
        },
    },
}
PLAIN_OF = {  # whose plain decoding each must equal
    "bfloat16+quantized_self": "bfloat16",
    "bfloat16+quantized_self int4": "bfloat16",
    "bfloat16+quantized_self k=4": "bfloat16",
}
QUANTIZATIONS = ("int8", "int4", "w8a8", "w4a8")  # whose quality is measured
SPECULATIVE = [name for name, options in ENGINES.items() if "speculative" in options]


def build_systems(names: list[str] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The engines named (default: all of :data:`ENGINES`) and llama.cpp where installed."""
    chosen = list(ENGINES) if names is None else names
    unknown = [n for n in chosen if n not in ENGINES]
    if unknown or "float32" not in chosen:
        raise ValueError(f"systems must include float32 and be some of {list(ENGINES)}")
    systems: dict[str, Any] = {
        name: LLM(kv_cache_memory_gb=0.5, **ENGINES[name]) for name in chosen
    }
    notes = []
    try:
        systems["llama.cpp"] = LlamaCpp()
    except ImportError:
        notes.append(
            "llama.cpp skipped: llama-cpp-python is not installed (pip install .[llamacpp])"
        )
    return systems, notes


def generate(system: Any, prompt: list[int], max_tokens: int) -> list[int]:
    if isinstance(system, LlamaCpp):
        return system.generate(prompt, max_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return system.generate([prompt], params)[0].token_ids


def speed(systems: dict[str, Any], prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Seconds and tokens per system, taking turns prompt by prompt; the outputs."""
    per_prompt: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list[list[int]]] = {name: [] for name in systems}
    for i, prompt in enumerate(prompts):
        order = list(systems) if i % 2 == 0 else list(reversed(systems))
        for name in order:
            start = time.perf_counter()
            outputs[name].append(generate(systems[name], prompt, max_tokens))
            per_prompt[name].append(time.perf_counter() - start)
    seconds = {name: sum(times) for name, times in per_prompt.items()}
    tokens = {name: sum(map(len, out)) for name, out in outputs.items()}
    return {
        "seconds": seconds,
        "tokens": tokens,
        "per_prompt_seconds": per_prompt,
        "outputs": outputs,
    }


def quality(prompts: list[list[int]], continuations: list[list[int]]) -> dict[str, Any]:
    """Top-1 agreement and mean log-likelihood difference against float32, teacher-forced.

    Each quantization is applied to a float32 ``transformers`` copy of the default model (its
    linears' weights replaced by their quantized values, exactly as the engine holds them, and
    for ``w*a8`` their inputs rounded to int8 as the kernel rounds them), which is run over each
    prompt and float32's greedy continuation.
    """
    from transformers import AutoModelForCausalLM

    from specdec.loader import default_model_dir
    from specdec.models.quant import dequantized_linears

    reference = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    models = {"float32": reference.eval()}
    for quantization in QUANTIZATIONS:
        copy = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
        models[quantization] = dequantized_linears(copy.eval(), quantization)
    logprobs: dict[str, list[torch.Tensor]] = {name: [] for name in models}
    for prompt, continuation in zip(prompts, continuations):
        ids = torch.tensor([prompt + continuation])
        for name, model in models.items():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [C, V]
            logprobs[name].append(torch.log_softmax(logits, dim=-1))
    report: dict[str, Any] = {}
    for name in QUANTIZATIONS:
        report[name] = {"weight_rel_change": weight_change(reference, models[name])}
        agree = total = 0
        loglik_diff = 0.0
        for ref, got, cont in zip(logprobs["float32"], logprobs[name], continuations):
            targets = torch.tensor(cont)
            agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
            total += len(cont)
            rows = torch.arange(len(cont))
            loglik_diff += float((got[rows, targets] - ref[rows, targets]).sum())
        report[name] |= {"top1_agreement": agree / total, "mean_loglik_diff": loglik_diff / total}
    return report


def weight_change(reference: torch.nn.Module, quantized: torch.nn.Module) -> float:
    """How far quantization moved the linears' weights: ``||W_q - W|| / ||W||`` over all of them."""
    moved = total = 0.0
    originals = dict(reference.named_modules())
    for name, module in quantized.named_modules():
        if isinstance(module, torch.nn.Linear):
            w = originals[name].weight.float()  # type: ignore[union-attr]
            moved += float((module.weight.float() - w).pow(2).sum())
            total += float(w.pow(2).sum())
    return (moved / total) ** 0.5


def weight_mb(model: Any) -> float:
    """Megabytes of weights one decode step of ``model`` reads (its floor: decode streams every
    matrix once)."""
    return model.weight_bytes_per_step() / 1e6


def bytes_bound(target_mb: float, draft_mb: float, drafts: float, accepted: float) -> float:
    """The most a drafter can gain on its target's plain decoding when both stream their weights
    from memory at the same rate: a verification emits ``accepted`` tokens (bonus included)
    for ``drafts`` draft steps of ``draft_mb`` and one target step of ``target_mb``, where plain
    decoding reads ``target_mb`` a token."""
    return accepted * target_mb / (drafts * draft_mb + target_mb)


def spec_summary(llm: LLM) -> dict[str, Any]:
    stats = llm.engine.verifier.stats
    steps = max(stats.num_verify_steps, 1)
    drafter = getattr(llm.engine.drafter, "runner", None)  # a draft model's own forwards
    draft_mb = 0.0 if drafter is None else weight_mb(drafter.model)
    target_mb, drafts = weight_mb(llm.engine.runner.model), stats.num_draft_tokens / steps
    return {
        "verify_steps": stats.num_verify_steps,
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "acceptance_per_position": stats.acceptance_per_position,
        "drafts_per_verification": drafts,
        "draft_mb": draft_mb,
        "bytes_bound": bytes_bound(target_mb, draft_mb, drafts, stats.mean_accepted_length),
    }


def markdown(result: dict[str, Any]) -> str:
    s = result["speed"]
    tps = {n: s["tokens"][n] / s["seconds"][n] for n in s["seconds"]}
    peer = tps.get("llama.cpp")
    lines = [
        f"{result['num_prompts']} prompts, {result['max_tokens']} new tokens each, greedy, "
        f"single stream, prompt processing included ({result['threads']} threads)",
        "",
        "| system | tokens/s | vs float32 | vs llama.cpp | output equals its plain decoding |",
        "|---|---|---|---|---|",
    ]
    for name, rate in tps.items():
        vs_peer = f"{rate / peer:.2f}x" if peer else "—"
        exact = result["exact"].get(name, "—")
        lines.append(
            f"| {name} | {rate:.1f} | {rate / tps['float32']:.2f}x | {vs_peer} | {exact} |"
        )
    lines.append("")
    styles = result["styles"]
    lines += [
        "",
        "tokens/s by prompt style (prompt tokens, mean): "
        + ", ".join(f"{st} {n:.0f}" for st, n in result["prompt_tokens_by_style"].items()),
        "",
        "| system | " + " | ".join(result["prompt_tokens_by_style"]) + " |",
        "|---|" + "---|" * len(result["prompt_tokens_by_style"]),
    ]
    for name in tps:
        cells = []
        for style in result["prompt_tokens_by_style"]:
            mine = [i for i, st in enumerate(styles) if st == style]
            secs = sum(s["per_prompt_seconds"][name][i] for i in mine)
            cells.append(f"{len(mine) * result['max_tokens'] / secs:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, spec in result["speculation"].items():
        lines.append(
            f"{name}: {spec['verify_steps']} verifications, mean accepted length "
            f"{spec['mean_accepted_length']:.2f} tokens (bonus included), acceptance rate "
            f"{spec['acceptance_rate']:.3f}, per position "
            + ", ".join(f"{a:.2f}" for a in spec["acceptance_per_position"])
        )
    mb = result["weight_mb"]
    lines += [
        "",
        "Weights a decode step reads (MB), and so the most each can gain on float32 in decode "
        "when weights stream from memory: "
        + ", ".join(
            f"{n} {v:.0f} ({mb['float32'] / v:.1f}x)" for n, v in mb.items() if n not in SPECULATIVE
        ),
    ]
    for name, spec in result["speculation"].items():
        lines.append(
            f"{name}: {spec['draft_mb']:.0f} MB a draft step, {mb[name]:.0f} MB a verification; "
            f"at {spec['drafts_per_verification']:.2f} drafts and "
            f"{spec['mean_accepted_length']:.2f} tokens a verification, bytes bound it at "
            f"{spec['bytes_bound']:.2f}x its target's plain decoding"
        )
    lines += [
        "",
        "| quantization | top-1 agreement with float32 | mean log-likelihood difference "
        "| weights moved (relative RMS) |",
        "|---|---|---|---|",
    ]
    for name, q in result["quality"].items():
        lines.append(
            f"| {name} | {q['top1_agreement']:.4f} | {q['mean_loglik_diff']:+.5f} "
            f"| {q['weight_rel_change']:.4f} |"
        )
    if result["int4_equals_float32"] is not None:
        same = "the same" if result["int4_equals_float32"] else "NOT the same"
        lines += ["", f"int4's greedy outputs are {same} as float32's on these prompts."]
    return "\n".join(lines + [""] + result["notes"]) + "\n"


def run_quant(
    conversations: list[list[dict[str, str]]],  # one prompt each
    styles: list[str],  # the category of each
    max_tokens: int,
    names: list[str] | None = None,  # engines of ENGINES to run (default: all)
) -> dict[str, Any]:
    """Time every system on every prompt, taking turns, then measure quality; the figures."""
    cpu_ops.extension()  # built (or loaded) here, untimed
    systems, notes = build_systems(names)
    llm = systems["float32"]
    prompts = [llm.apply_chat_template(c) for c in conversations]
    with torch.inference_mode():
        speed(systems, prompts[:1], 8)  # warm every system up
        for llm_system in systems.values():
            if isinstance(llm_system, LLM):
                llm_system.engine.verifier.stats = SpecStats()  # count the timed run only
        timed = speed(systems, prompts, max_tokens)
        quality_report = quality(prompts, timed["outputs"]["float32"])
    outputs = timed.pop("outputs")
    exact = {
        name: "yes" if outputs[name] == outputs[plain] else "NO"
        for name, plain in PLAIN_OF.items()
        if name in outputs and plain in outputs
    }
    return {
        "num_prompts": len(prompts),
        "max_tokens": max_tokens,
        "threads": torch.get_num_threads(),
        "speed": timed,
        "styles": styles,
        "prompt_tokens_by_style": {
            style: sum(len(p) for p, st in zip(prompts, styles) if st == style)
            / styles.count(style)
            for style in dict.fromkeys(styles)
        },
        "exact": exact,
        "speculation": {
            name: spec_summary(systems[name]) for name in SPECULATIVE if name in systems
        },
        "quality": quality_report,
        "weight_mb": {
            n: weight_mb(llm.engine.runner.model)
            for n, llm in systems.items()
            if isinstance(llm, LLM)
        },
        "notes": notes,
        "int4_equals_float32": outputs.get("int4") == outputs["float32"]
        if "int4" in outputs
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts-per-style", type=int, default=3, metavar="N")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="1 prompt per style, 32 tokens")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    per_style, max_tokens = (1, 32) if args.quick else (args.prompts_per_style, args.max_tokens)
    groups = by_category(read_questions(), per_style)
    styles = [category for category, questions in groups.items() for _ in questions]
    conversations = [q.conversation() for qs in groups.values() for q in qs]
    print(f"timing {len(ENGINES)} systems on {len(conversations)} prompts ...", flush=True)
    result = run_quant(conversations, styles, max_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (args.out / "quant.md").write_text(table)
    print(table)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
