"""What ``specdec bench`` writes: the environment, the Markdown report and the plots."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from specdec.eval.bench.recommend import best_per_category
from specdec.eval.bench.systems import HF, PLAIN


def environment(dtype: str) -> dict[str, Any]:
    """Versions, CPU, dtype and threads: what a figure depends on besides the code."""
    versions = {}
    for package in ("specdec", "torch", "transformers", "triton", "llama_cpp_python"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    flags = ""
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").is_file():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == platform.machine():
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                have = set(line.split(":", 1)[1].split())
                wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16")
                flags = " ".join(f for f in wanted if f in have)
    return {
        "versions": versions,
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_flags": flags,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "dtype": dtype,
    }


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}x" if key in row else "—"


def offline_markdown(offline: dict[str, Any]) -> str:
    """Speedup per category per system, then acceptance, then any mismatch."""
    names = offline["systems"]
    sections = [("overall", offline["overall"]), *offline["categories"].items()]
    lines = [
        "| category | " + " | ".join(names) + " | prompt-lookup ceiling |",
        "|---" * (len(names) + 2) + "|",
    ]
    for category, figures in sections:
        cells = []
        for name in names:
            row = figures["systems"][name]
            cell = f"{row['tok_s']:.1f} tok/s"
            if name != PLAIN:
                cell += f" ({row['vs_specdec']:.2f}x)"
            cells.append(cell)
        ceiling = figures["prompt_lookup_ceiling_tokens_per_step"]
        lines.append(f"| {category} | " + " | ".join(cells) + f" | {ceiling:.2f} |")
    lines.append(
        f"\nTokens/s, single stream, {offline.get('decoding', 'greedy')} (ratio to the engine "
        "without speculation). "
        "Prompt-lookup ceiling: tokens per target step of an oracle lookup on these outputs."
    )
    if HF in names:
        overall = offline["overall"]["systems"]
        versus = ", ".join(f"{n} {_ratio(overall[n], 'vs_hf')}" for n in names if n != HF)
        lines.append(f"\nAgainst transformers `generate`, overall: {versus}.")
    drafters = [n for n in names if "drafter" in offline["overall"]["systems"][n]]
    if drafters:
        lines += [
            "\n| category | drafter | acceptance | mean accepted length | per position |",
            "|---|---|---|---|---|",
        ]
        for category, figures in sections:
            for name in drafters:
                row = figures["systems"][name]
                per = " ".join(f"{a:.2f}" for a in row["acceptance_per_position"])
                lines.append(
                    f"| {category} | {name} | {row['acceptance_rate']:.0%} | "
                    f"{row['mean_accepted_length']:.2f} | {per} |"
                )
    if offline["mismatches"]:
        lines.append(f"\n**OUTPUTS DIFFER FROM PLAIN DECODING: {len(offline['mismatches'])}**\n")
        for m in offline["mismatches"][:20]:
            lines.append(
                f"- {m['system']}, {m['category']} question {m['question_id']} turn "
                f"{m['turn']}: first difference at token {m['first_difference']}"
            )
    else:
        lines.append("\nEvery drafter's output equals plain decoding, turn by turn.")
    return "\n".join(lines) + "\n"


def load_markdown(load: dict[str, Any]) -> str:
    lines = [
        "| system | rate (req/s) | done | tokens/s | TTFT p50/p90/p99 ms | "
        "ITL p50/p90/p99 ms | latency p50/p90/p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, points in load["curves"].items():
        for p in points:
            triple = {
                m: "/".join(f"{p[f'{m}_p{q}_ms']:.0f}" for q in (50, 90, 99))
                for m in ("ttft", "itl", "latency")
            }
            lines.append(
                f"| {name} | {p['rate']:.2f} | {p['requests_ok']:.0f} | "
                f"{p['output_tokens_per_s']:.1f} | {triple['ttft']} | {triple['itl']} | "
                f"{triple['latency']} |"
            )
    for name, where in load.get("paying", {}).items():
        lines.append(f"\n{name}: {where} (median latency against the engine without it).")
    for note in load.get("notes", []):
        lines.append(f"\n{note}")
    return "\n".join(lines) + "\n"


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    parts = [
        "# specdec bench\n",
        f"{env['cpu']} ({env['cpu_flags'] or 'no AVX flags seen'}), {env['threads']} threads, "
        f"dtype {env['dtype']}, torch {env['versions'].get('torch', '?')}; dataset "
        f"{result['dataset']}.\n",
    ]
    if "recommendation" in result:
        parts.append(f"**Recommendation.** {result['recommendation']['reason']}\n")
        best = best_per_category(result["offline"])
        if best:
            parts.append(
                "Best exact drafter per category: "
                + ", ".join(f"{c} {name} ({x:.2f}x)" for c, (name, x) in best.items())
                + ".\n"
            )
    if "offline" in result:
        parts += ["## Offline, single stream\n", offline_markdown(result["offline"])]
    if "load" in result:
        parts += ["## Under load (open-loop Poisson arrivals)\n", load_markdown(result["load"])]
    if "runtime" in result:
        from specdec.eval.bench.runtime import markdown as runtime_markdown

        parts += ["## Runtime, without speculation\n", runtime_markdown(result["runtime"])]
    if "kernels" in result:
        from specdec.eval.bench.kernels import markdown as kernels_markdown

        parts += ["## Verification kernel\n", kernels_markdown(result["kernels"])]
    if "attention" in result:
        from specdec.eval.bench.attention import markdown as attention_markdown

        parts += ["## CPU attention kernels\n", attention_markdown(result["attention"])]
    if "wrap" in result:
        from specdec.eval.bench.wrap import markdown as wrap_markdown

        parts += ["## specdec.wrap against transformers generate\n", wrap_markdown(result["wrap"])]
    if "embed" in result:
        from specdec.eval.bench.embed import markdown as embed_markdown

        parts += ["## LLM.embed against transformers\n", embed_markdown(result["embed"])]
    if result.get("lora"):
        from specdec.eval.bench.lora import markdown as lora_markdown

        parts += ["## LoRA adapters\n", lora_markdown(result["lora"])]
    if result.get("guided"):
        from specdec.eval.bench.guided import markdown as guided_markdown

        parts += ["## Grammar-guided decoding\n", guided_markdown(result["guided"])]
    if result.get("quant"):
        from specdec.eval.bench.quant import markdown as quant_markdown

        parts += ["## Quantized weights and quantized_self\n", quant_markdown(result["quant"])]
    parts += [f"- {note}\n" for note in result.get("notes", [])]
    return "\n".join(parts)


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """PNG plots: speedup by category per drafter; latency against request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if "offline" in result:
        offline = result["offline"]
        categories = [*offline["categories"], "overall"]
        names = [n for n in offline["systems"] if n != PLAIN]
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories)), 4))
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            values = [
                (offline["categories"].get(c) or offline["overall"])["systems"][name]["vs_specdec"]
                for c in categories
            ]
            ax.bar([j + i * width for j in range(len(categories))], values, width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories)
        ax.set_ylabel("speedup over no speculation")
        ax.set_title("Single-stream speedup by category")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.autofmt_xdate()
        fig.tight_layout()
        written.append(out / "speedup_by_category.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    if "load" in result:
        fig, ax = plt.subplots(figsize=(8, 4))
        for name, points in result["load"]["curves"].items():
            rates = [p["rate"] for p in points]
            ax.plot(rates, [p["latency_p50_ms"] for p in points], marker="o", label=f"{name} p50")
            ax.plot(
                rates, [p["latency_p90_ms"] for p in points], linestyle="--", label=f"{name} p90"
            )
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel("end-to-end latency (ms)")
        ax.set_title("Latency against request rate")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        written.append(out / "latency_vs_rate.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
