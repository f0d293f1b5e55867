"""Speculative decoding benchmark: which drafter pays off, per prompt style, side by side.

    python -m specdec.eval.bench_spec [--dtype bfloat16] [--draft-model DIR]
        [--eagle-heads DIR] [--medusa-heads DIR] [--styles chat,math] [--no-hf]
        [--concurrent N] [--prompts-per-style N] [--quick]

On the default model, for each prompt style (``eval/prompts/{summarization,retrieval,
code_editing,chat,math,translation}.jsonl``) it times single-stream greedy generation of the
first ``N`` prompts (default 5, 0 takes all) with: the engine without speculation, with prompt
lookup, with a draft model (when one is given or has been distilled, see ``python -m
specdec.drafters.distill``), with EAGLE and Medusa heads (given, or the shipped ones, see
``specdec train-heads``), ``transformers`` ``generate``, and ``transformers``
``generate(prompt_lookup_num_tokens=10)``. The fused CPU kernels are built and every system
generates once before anything is timed, so no one-time cost enters a figure. The systems take
turns on each prompt, in order and then in reverse order, so drift in machine load hits all
alike. It also reports each drafter's mean accepted length, acceptance rate and acceptance per
draft position per style, the
ceiling no prompt lookup can pass on these outputs (:func:`lookup_ceiling`), how much the outputs
copy from their prompts by a fixed yardstick (:func:`reference_lookup`: a greedy-verified 3-gram
lookup with ``k = 8``, the figure issue #4 states its goals against), all styles together, and
the throughput of the 32 concurrent requests of ``runtime.jsonl`` with and without each drafter.
Results: ``eval/results/spec_{dtype}.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specdec import LLM, SamplingParams, SpecConfig
from specdec.drafters.heads import default_heads
from specdec.drafters.prompt_lookup import lookup
from specdec.eval.prompts import STYLES, conversation, load_prompts
from specdec.kernels import cpu_ops

RESULTS = Path("eval/results")
WARM_UP_PROMPT = [*range(1000, 1032)] * 2  # repeats itself, so prompt lookup drafts and verifies


def build_systems(
    dtype: str,
    draft_model: str | None,
    heads: dict[str, str | None] | None = None,
    with_hf: bool = True,
) -> dict[str, Any]:
    """The systems to compare; ``heads``: a heads directory per kind (``eagle``, ``medusa``),
    None for the shipped default, where there is one."""
    from transformers import AutoModelForCausalLM

    from specdec.loader import default_model_dir

    options: dict[str, Any] = {"dtype": dtype, "kv_cache_memory_gb": 1.0}
    systems: dict[str, Any] = {
        "specdec": LLM(**options),
        "specdec+prompt_lookup": LLM(**options, speculative={"drafter": "prompt_lookup"}),
    }
    if draft_model:
        systems["specdec+draft_model"] = LLM(
            **options,
            speculative={
                "drafter": "draft_model",
                "draft_model": draft_model,
                "num_speculative_tokens": 4,
            },
        )
    for kind, directory in (heads or {}).items():
        systems[f"specdec+{kind}"] = LLM(
            **options, speculative=SpecConfig(kind, 8, heads=directory)
        )
    if with_hf:
        hf = AutoModelForCausalLM.from_pretrained(
            default_model_dir(), dtype=systems["specdec"].dtype
        )
        systems["hf"] = hf.eval()
    return systems


def run_once(name: str, system: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Generate greedily; return (seconds, the generated token ids)."""
    start = time.perf_counter()
    if name.startswith("hf"):
        extra = {"prompt_lookup_num_tokens": 10} if name == "hf+prompt_lookup" else {}
        out = system.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            **extra,
        )
        token_ids = out[0, len(prompt) :].tolist()
    else:
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        token_ids = system.generate([prompt], params)[0].token_ids
    return time.perf_counter() - start, token_ids


def lookup_ceiling(prompt: list[int], output: list[int], spec: SpecConfig) -> tuple[int, int]:
    """(tokens, target steps) to produce the greedy ``output`` with an *oracle* prompt lookup.

    At every step the oracle drafts, out of every earlier occurrence of the last
    ``prompt_lookup_min`` tokens, the (at most ``k``-token) continuation that ``output`` accepts
    longest. Each verification step yields its accepted drafts + 1, so no n-gram lookup with
    these settings, however it chooses its match and ``k``, gets more tokens per target step:
    prompt lookup cannot speed decoding up by more than ``tokens / steps`` on this text.
    """
    k, n = spec.num_speculative_tokens, spec.options.prompt_lookup_min
    tokens = np.asarray(prompt + output, dtype=np.int64)
    pos, steps = len(prompt), 0
    j = np.arange(k)
    while pos < len(tokens):
        best = 0
        if pos > n:
            windows = sliding_window_view(tokens[: pos - 1], n)  # n-grams that end before pos
            follow = np.flatnonzero((windows == tokens[pos - n : pos]).all(axis=1)) + n  # [F]
            draft_at = follow[:, None] + j  # [F, k] positions of each candidate's drafts
            target_at = pos + j  # [k]
            valid = (draft_at < pos) & (target_at < len(tokens))  # inside the history / output
            same = valid & (
                tokens[np.minimum(draft_at, pos - 1)]
                == tokens[np.minimum(target_at, len(tokens) - 1)]
            )
            if follow.size:
                best = int(np.cumprod(same, axis=1).sum(axis=1).max())
        pos, steps = pos + best + 1, steps + 1
    return len(output), steps


def reference_lookup(
    prompt: list[int], output: list[int], n: int = 3, k: int = 8
) -> tuple[int, int]:
    """(tokens, target steps) to produce ``output`` with a greedy-verified ``n``-gram lookup that
    drafts ``k`` tokens at every step where the last ``n`` tokens occurred before.

    A yardstick of how much a style's outputs copy from their prompts, independent of the
    drafter's settings and policy: issue #4 expects about 1.8 tokens per step on summarization
    and 2.2 on retrieval-grounded prompts.
    """
    tokens, steps, pos = prompt + output, 0, 0
    while pos < len(output):
        drafts = lookup(tokens[: len(prompt) + pos], k, n, n)
        accepted = 0
        while (
            accepted < len(drafts)
            and pos + accepted < len(output) - 1  # the last token comes from a step of its own
            and drafts[accepted] == output[pos + accepted]
        ):
            accepted += 1
        pos, steps = pos + accepted + 1, steps + 1
    return len(output), steps


def single_stream(
    systems: dict[str, Any], records: list[dict[str, Any]], quick: bool
) -> dict[str, Any]:
    chat = systems["specdec"]
    prompts = [chat.apply_chat_template(conversation(r)) for r in records]
    names = [*systems, *(["hf+prompt_lookup"] if "hf" in systems else [])]
    before = {n: _counters(systems[n]) for n in names if n.startswith("specdec+")}
    seconds = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    ceiling, reference = [0, 0], [0, 0]  # tokens, steps
    identical = {n: 0 for n in names if n.startswith("specdec+")}  # outputs equal to plain's
    for prompt, record in zip(prompts, records):
        plain: list[int] = []
        max_tokens = record["max_tokens"] // (4 if quick else 1)
        for turn, name in enumerate([*names, *reversed(names)]):  # A B C .. C B A
            system = systems["hf" if name.startswith("hf") else name]
            elapsed, token_ids = run_once(name, system, prompt, max_tokens)
            seconds[name] += elapsed
            tokens[name] += len(token_ids)
            if name in identical and turn < len(names):
                identical[name] += token_ids == plain
            if turn == 0:  # the engine without speculation: its greedy output
                plain = token_ids
                spec = systems["specdec+prompt_lookup"].spec_config
                for i, count in enumerate(lookup_ceiling(prompt, token_ids, spec)):
                    ceiling[i] += count
                for i, count in enumerate(reference_lookup(prompt, token_ids)):
                    reference[i] += count
    row: dict[str, Any] = {f"{n}_tok_s": tokens[n] / seconds[n] for n in names}
    row["prompt_lookup_ceiling_tokens_per_step"] = ceiling[0] / max(1, ceiling[1])
    row["reference_3gram_tokens_per_step"] = reference[0] / max(1, reference[1])
    row.update({f"{n}_tokens": tokens[n] for n in names})
    row.update({f"{n}_seconds": seconds[n] for n in names})
    row.update({f"{n}_identical_outputs": same for n, same in identical.items()})
    row["num_prompts"] = len(prompts)
    base = row["specdec_tok_s"]
    for n in names:
        row[f"{n}_vs_specdec"] = row[f"{n}_tok_s"] / base
    for n, (drafts, accepted, steps, per_drafted, per_accepted) in before.items():
        d1, a1, s1, pd1, pa1 = _counters(systems[n])
        row[f"{n}_mean_accepted_length"] = (a1 - accepted + s1 - steps) / max(1, s1 - steps)
        row[f"{n}_acceptance_rate"] = (a1 - accepted) / max(1, d1 - drafts)
        row[f"{n}_acceptance_per_position"] = [
            round(
                (a - (per_accepted[j] if j < len(per_accepted) else 0))
                / max(1, d - (per_drafted[j] if j < len(per_drafted) else 0)),
                3,
            )
            for j, (d, a) in enumerate(zip(pd1, pa1))
        ]
    return row


def _counters(llm: LLM) -> tuple[int, int, int, list[int], list[int]]:
    s = llm.engine.verifier.stats
    return (
        s.num_draft_tokens,
        s.num_accepted_tokens,
        s.num_verify_steps,
        list(s.drafted_per_position),
        list(s.accepted_per_position),
    )


def concurrent(systems: dict[str, Any], num_requests: int) -> dict[str, float]:
    records = load_prompts("runtime")[:num_requests]
    chat = systems["specdec"]
    prompts = [chat.apply_chat_template(conversation(r)) for r in records]
    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in records
    ]
    names = [n for n in systems if n == "specdec" or n.startswith("specdec+")]
    names = [n for n in names if n != "specdec+draft_model"]  # not built for batches
    times = dict.fromkeys(names, 0.0)
    for name in names:
        systems[name].generate(prompts[:2], params[:2])  # warm up
    outputs: dict[str, list[list[int]]] = {}
    for name in (*names, *reversed(names)):  # A B C C B A: drift in machine load hits all alike
        start = time.perf_counter()
        done = systems[name].generate(prompts, params)
        times[name] += time.perf_counter() - start
        outputs.setdefault(name, [o.token_ids for o in done])
    useful = sum(p.max_tokens for p in params)
    result: dict[str, Any] = {"num_requests": len(prompts)}
    result["specdec_tok_s"] = 2 * useful / times["specdec"]
    for name in names[1:]:
        drafter = name.removeprefix("specdec+")
        result[f"{drafter}_tok_s"] = 2 * useful / times[name]
        result[f"{drafter}_vs_specdec"] = times["specdec"] / times[name]
        result[f"{drafter}_identical_outputs"] = sum(
            a == b for a, b in zip(outputs["specdec"], outputs[name])
        )
    return result


def markdown(result: dict[str, Any]) -> str:
    rows = result["single_stream"]
    first = next(iter(rows.values()))
    names = [k.removesuffix("_tok_s") for k in first if k.endswith("_tok_s")]
    lines = [
        "| style | "
        + " | ".join(names)
        + " | mean accepted length | lookup ceiling | 3-gram reference"
        + " | outputs identical to plain |",
        "|---" * (len(names) + 5) + "|",
    ]
    for style, row in rows.items():
        cells = [f"{row[f'{n}_tok_s']:.1f} ({row[f'{n}_vs_specdec']:.2f}x)" for n in names]
        mal = ", ".join(
            f"{n.removeprefix('specdec+')}: {row[f'{n}_mean_accepted_length']:.2f}"
            for n in names
            if f"{n}_mean_accepted_length" in row
        )
        ceiling = row["prompt_lookup_ceiling_tokens_per_step"]
        reference = row["reference_3gram_tokens_per_step"]
        same = ", ".join(
            f"{n.removeprefix('specdec+')}: {row[f'{n}_identical_outputs']}/{row['num_prompts']}"
            for n in names
            if f"{n}_identical_outputs" in row
        )
        lines.append(
            f"| {style} | "
            + " | ".join(cells)
            + f" | {mal} | {ceiling:.2f} | {reference:.2f} | {same} |"
        )
    overall = {
        n: sum(r[f"{n}_tokens"] for r in rows.values())
        / sum(r[f"{n}_seconds"] for r in rows.values())
        for n in names
    }
    versus_hf = (
        f" and {overall['specdec+prompt_lookup'] / overall['hf+prompt_lookup']:.2f}x "
        "transformers' prompt lookup"
        if "hf+prompt_lookup" in overall
        else ""
    )
    together = ", ".join(
        f"{n.removeprefix('specdec+')} {overall[n] / overall['specdec']:.2f}x"
        for n in overall
        if n.startswith("specdec+")
    )
    lines.append(
        f"\nAll styles together, against the engine without speculation: {together}"
        f"{versus_hf}. Lookup ceiling: tokens per target step of an oracle "
        "that drafts, at every step, the best continuation of any earlier occurrence of the "
        "last prompt_lookup_min tokens (see lookup_ceiling): no prompt lookup can beat that "
        "speedup on these outputs. 3-gram reference: tokens per step of a greedy-verified "
        "3-gram lookup drafting 8 tokens wherever it matches (see reference_lookup), a measure "
        "of how much the outputs copy from their prompts."
    )
    for style, row in rows.items():
        for n in names:
            if f"{n}_acceptance_per_position" in row:
                per = " ".join(f"{a:.2f}" for a in row[f"{n}_acceptance_per_position"])
                lines.append(
                    f"\n{style}, {n.removeprefix('specdec+')}: acceptance per position {per}"
                )
    c = result["concurrent"]
    for key in c:
        if key.endswith("_vs_specdec"):
            drafter = key.removesuffix("_vs_specdec")
            lines.append(
                f"\n{c['num_requests']} concurrent requests: {drafter} "
                f"{c[f'{drafter}_tok_s']:.1f} tok/s vs {c['specdec_tok_s']:.1f} without "
                f"({c[key]:.2f}x); outputs identical to plain: "
                f"{c[f'{drafter}_identical_outputs']}/{c['num_requests']}."
            )
    n = result["prompts_per_style"]
    prompts = f"the first {n} prompts" if n else "all prompts"
    kernels = "" if result["cpu_kernels"] else ", WITHOUT the fused CPU kernels (torch fallback)"
    return (
        f"dtype {result['dtype']}{kernels}, {prompts} of each style, "
        "tokens/s (ratio to specdec without speculation)\n\n" + "\n".join(lines) + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--draft-model", default=None, help="HF directory of a draft model")
    parser.add_argument(
        "--prompts-per-style",
        type=int,
        default=None,
        metavar="N",
        help="the first N prompts of each style (default 5, 2 with --quick; 0: all)",
    )
    parser.add_argument("--quick", action="store_true", help="2 prompts per style, short outputs")
    for kind in ("eagle", "medusa"):
        parser.add_argument(
            f"--{kind}-heads",
            default=None,
            metavar="DIR",
            help=f"{kind} heads to compare (default: the shipped ones, if any; 'none': skip)",
        )
    parser.add_argument("--styles", default=",".join(STYLES), help="comma-separated styles")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers systems")
    parser.add_argument(
        "--concurrent", type=int, default=32, metavar="N", help="requests run at once (max 32)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    per_style = args.prompts_per_style
    if per_style is None:
        per_style = 2 if args.quick else 5
    if per_style < 0:
        parser.error("--prompts-per-style must be 0 (all) or more")
    result: dict[str, Any] = {
        "dtype": args.dtype,
        "prompts_per_style": per_style,
        "cpu_kernels": cpu_ops.extension() is not None,  # built (or loaded) here, untimed
        "single_stream": {},
    }
    heads = {}
    for kind in ("eagle", "medusa"):
        given = getattr(args, f"{kind}_heads")
        if given != "none" and (given or (default_heads(kind) / "config.json").is_file()):
            heads[kind] = given
    systems = build_systems(args.dtype, args.draft_model, heads, with_hf=not args.no_hf)
    with torch.inference_mode():
        for name in [*systems, *(["hf+prompt_lookup"] if "hf" in systems else [])]:  # warm up
            system = systems["hf" if name.startswith("hf") else name]
            run_once(name, system, WARM_UP_PROMPT, 8)
        for style in args.styles.split(","):
            print(f"[{args.dtype}] {style} ...", flush=True)
            records = load_prompts(style)[: per_style or None]
            result["single_stream"][style] = single_stream(systems, records, args.quick)
        print(f"[{args.dtype}] concurrent requests ...", flush=True)
        result["concurrent"] = concurrent(systems, 8 if args.quick else args.concurrent)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"spec_{args.dtype}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (args.out / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
