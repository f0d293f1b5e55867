"""The ``specdec`` command line."""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from specdec.cli_options import model_options, spec_config, speculation_options
from specdec.config import SamplingParams
from specdec.serving.cli import serve


@click.group()
@click.version_option(package_name="specdec")
def main() -> None:
    """specdec: exact speculative decoding on a paged-KV, continuously batched runtime."""


@main.command()
@click.argument("prompts", nargs=-1, required=True)
@model_options
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option(
    "--temperature", default=0.0, show_default=True, type=float, help="0 decodes greedily."
)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--seed", default=None, type=int, help="Per-request seed for reproducible sampling.")
@click.option("--raw", is_flag=True, help="Use prompts as raw text (skip the chat template).")
@speculation_options
@click.option("--stats", is_flag=True, help="Print the speculation summary.")
def generate(
    prompts: tuple[str, ...],
    model: str | None,
    dtype: str,
    quantization: str | None,
    batch_invariant: bool | None,
    raw: bool,
    stats: bool,
    drafter: str,
    draft_model: str | None,
    num_speculative_tokens: int,
    draft_quantization: str | None,
    heads: str | None,
    **sampling: Any,
) -> None:
    """Generate a completion for each PROMPT, in one continuous batch."""
    from specdec.llm import LLM

    try:
        params = SamplingParams(**sampling)
        speculative = spec_config(
            drafter,
            num_speculative_tokens,
            draft_model=draft_model,
            draft_quantization=draft_quantization,
            heads=heads,
        )
        llm = LLM(
            model,
            dtype=dtype,
            quantization=quantization,
            speculative=speculative,
            batch_invariant=batch_invariant,
        )
        start = time.perf_counter()
        if raw:
            outputs = llm.generate(list(prompts), params)
        else:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        elapsed = time.perf_counter() - start
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    for prompt, out in zip(prompts, outputs):
        click.echo(
            f"### {prompt}\n{out.text.strip()}\n[{len(out.token_ids)} tokens, "
            f"finish_reason={out.finish_reason}]\n"
        )
    num_tokens = sum(len(o.token_ids) for o in outputs)
    click.echo(
        f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tokens/s)", err=True
    )
    if stats:
        click.echo(spec_summary(llm), err=True)


def spec_summary(llm: Any) -> str:
    s = llm.engine.verifier.stats
    positions = " ".join(f"{a:.2f}" for a in s.acceptance_per_position) or "-"
    return (
        f"speculation: {s.num_draft_tokens} draft tokens in {s.num_verify_steps} verify steps, "
        f"{s.num_accepted_tokens} accepted (acceptance rate {s.acceptance_rate:.2f}, "
        f"mean accepted length {s.mean_accepted_length:.2f}); per position: {positions}"
    )


@main.command("train-heads")
@click.option("--kind", required=True, type=click.Choice(["eagle", "medusa"]))
@click.option(
    "--out", required=True, help="Directory for the heads (and checkpoints, corpus, log)."
)
@click.option("--model", default=None, help="The target (default: the embedded SmolLM2-135M).")
@click.option("--data", default=None, help="Training prompts, JSONL (default: ours).")
@click.option(
    "--dtype",
    default="float32",
    show_default=True,
    type=click.Choice(["float32", "bfloat16"]),
    help="The target's dtype while it writes the corpus and the features.",
)
@click.option("--max-steps", default=1500, show_default=True, type=int)
@click.option(
    "--max-train-tokens",
    default=200_000,
    show_default=True,
    type=int,
    help="Corpus size: prompt + response tokens the target writes.",
)
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--batch-tokens", default=4096, show_default=True, type=int)
@click.option("--lr", default=1e-3, show_default=True, type=float)
@click.option("--draft-vocab-size", default=8192, show_default=True, type=int)
@click.option("--num-heads", default=4, show_default=True, type=int, help="medusa's heads.")
@click.option("--save-every", default=250, show_default=True, type=int)
def train_heads(data: str | None, **options: Any) -> None:
    """Train EAGLE or Medusa heads for a target, on its own answers to our training prompts;
    a rerun with the same --out resumes from the latest checkpoint."""
    from specdec.drafters.train_heads import TrainConfig, train

    try:
        if data:
            options["data"] = data
        config = TrainConfig(**options)
        out = train(config)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"{config.kind} heads written to {out}")


main.add_command(serve)

if __name__ == "__main__":
    sys.exit(main())
