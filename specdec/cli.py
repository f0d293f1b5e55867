"""The ``specdec`` command line."""

from __future__ import annotations

import sys
import time

import click

from specdec.config import SamplingParams


@click.group()
@click.version_option(package_name="specdec")
def main() -> None:
    """specdec: exact speculative decoding on a paged-KV, continuously batched runtime."""


@main.command()
@click.argument("prompts", nargs=-1, required=True)
@click.option(
    "--model",
    default=None,
    help="HF model directory or GGUF file (default: the embedded SmolLM2-135M-Instruct).",
)
@click.option(
    "--dtype", default="float32", type=click.Choice(["float32", "bfloat16"]), show_default=True
)
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option(
    "--temperature", default=0.0, show_default=True, type=float, help="0 decodes greedily."
)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--seed", default=None, type=int, help="Per-request seed for reproducible sampling.")
@click.option("--raw", is_flag=True, help="Use prompts as raw text (skip the chat template).")
def generate(
    prompts: tuple[str, ...],
    model: str | None,
    dtype: str,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    raw: bool,
) -> None:
    """Generate a completion for each PROMPT, in one continuous batch."""
    from specdec.llm import LLM

    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
        )
        llm = LLM(model, dtype=dtype)
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


if __name__ == "__main__":
    sys.exit(main())
