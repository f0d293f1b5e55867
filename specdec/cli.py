"""The ``specdec`` command line."""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from specdec.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from specdec.cli_options import (
    guide_options,
    model_options,
    read_guides,
    spec_config,
    speculation_options,
)
from specdec.config import SamplingParams
from specdec.outputs import TokenLogprobs
from specdec.serving.cli import serve
from specdec.structured.params import GUIDES


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
@click.option("--repetition-penalty", default=1.0, show_default=True, type=float)
@click.option("--presence-penalty", default=0.0, show_default=True, type=float)
@click.option("--frequency-penalty", default=0.0, show_default=True, type=float)
@click.option(
    "--logprobs",
    default=None,
    type=int,
    help="Print each token's logprob and this many most likely tokens' (0-20).",
)
@click.option(
    "--prompt-logprobs",
    default=None,
    type=int,
    help="Print each prompt token's logprob and this many alternatives (0-20), and their sum.",
)
@guide_options
@click.option("--raw", is_flag=True, help="Use prompts as raw text (skip the chat template).")
@click.option(
    "--beam-width",
    default=None,
    type=click.IntRange(1, MAX_BEAM_WIDTH),
    help="Beam search of this width instead of sampling: print each prompt's best beams.",
)
@click.option(
    "--length-penalty",
    default=1.0,
    show_default=True,
    type=float,
    help="With --beam-width: beams ranked by logprob sum / length ** this.",
)
@speculation_options
@click.option("--stats", is_flag=True, help="Print the speculation summary.")
@click.option(
    "--lora", default=None, help="Generate through this PEFT LoRA adapter (its directory)."
)
def generate(
    prompts: tuple[str, ...],
    model: str | None,
    dtype: str,
    quantization: str | None,
    batch_invariant: bool | None,
    device: str,
    cuda_graphs: bool,
    raw: bool,
    stats: bool,
    drafter: str,
    draft_model: str | None,
    num_speculative_tokens: int,
    draft_quantization: str | None,
    heads: str | None,
    lookup_first: int | None,
    beam_width: int | None,
    length_penalty: float,
    lora: str | None,
    **sampling: Any,
) -> None:
    """Generate a completion for each PROMPT, in one continuous batch (or, with --beam-width,
    search each one's best continuations)."""
    from specdec.llm import LLM
    from specdec.lora import LoRARequest, adapter_rank

    try:
        read_guides(sampling)
        params = SamplingParams(**sampling)
        speculative = spec_config(
            drafter,
            num_speculative_tokens,
            draft_model=draft_model,
            draft_quantization=draft_quantization,
            heads=heads,
            lookup_first=lookup_first,
        )
        adapters: dict[str, Any] = (
            {"enable_lora": True, "max_lora_rank": adapter_rank(lora)} if lora else {}
        )
        llm = LLM(
            model,
            dtype=dtype,
            quantization=quantization,
            speculative=speculative,
            batch_invariant=batch_invariant,
            device=device,
            cuda_graphs=cuda_graphs,
            **adapters,
        )
        adapter = LoRARequest("adapter", 1, lora) if lora else None
        if beam_width is not None:
            return beam_search(llm, prompts, raw, params, beam_width, length_penalty, adapter)
        start = time.perf_counter()
        if raw:
            outputs = llm.generate(list(prompts), params, lora_request=adapter)
        else:
            chats = [[{"role": "user", "content": p}] for p in prompts]
            outputs = llm.chat(chats, params, lora_request=adapter)
        elapsed = time.perf_counter() - start
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    for prompt, out in zip(prompts, outputs):
        click.echo(
            f"### {prompt}\n{out.text.strip()}\n[{len(out.token_ids)} tokens, "
            f"finish_reason={out.finish_reason}]\n"
        )
        if out.prompt_logprobs:
            scored = [lp for lp in out.prompt_logprobs if lp is not None]
            total = sum(lp.logprob for lp in scored)
            click.echo(f"prompt: log-likelihood {total:.3f} over {len(scored)} tokens")
            echo_logprobs(llm.tokenizer, scored)
        if out.logprobs:
            if out.prompt_logprobs:
                click.echo("output:")
            echo_logprobs(llm.tokenizer, out.logprobs)
    num_tokens = sum(len(o.token_ids) for o in outputs)
    click.echo(
        f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tokens/s)", err=True
    )
    if stats:
        click.echo(spec_summary(llm), err=True)


def beam_search(
    llm: Any,
    prompts: tuple[str, ...],
    raw: bool,
    params: SamplingParams,
    width: int,
    penalty: float,
    adapter: Any = None,  # noqa: ANN401 - a LoRARequest
) -> None:
    """``generate --beam-width``: each prompt's ``width`` best beams, best first, with their
    summed logprobs (only ``--max-tokens``, the prompt and the adapter shape them)."""
    sampled = params.temperature > 0 or params.logprobs is not None or params.has_penalties
    if sampled or any(getattr(params, name) for name in GUIDES):
        raise click.ClickException(
            "--beam-width ranks beams by the model's own logprobs: leave --temperature, the "
            "penalties, --logprobs and the guides (--choice, --regex, --json-schema, --grammar, "
            "--structural-tag) unset"
        )
    texts = [p if raw else llm.render_chat([{"role": "user", "content": p}]) for p in prompts]
    start = time.perf_counter()
    search = BeamSearchParams(width, params.max_tokens, length_penalty=penalty)
    results = llm.beam_search(texts, search, lora_request=adapter)
    elapsed = time.perf_counter() - start
    for prompt, result in zip(prompts, results):
        click.echo(f"### {prompt}")
        for rank, beam in enumerate(result.sequences, 1):
            end = "stop" if beam.finished else "length"
            click.echo(
                f"[{rank}] {beam.text.strip()}\n    [{len(beam.token_ids)} tokens, "
                f"logprob sum {beam.cum_logprob:.3f}, finish_reason={end}]"
            )
        click.echo("")
    click.echo(f"{len(prompts)} prompts, {width} beams each, in {elapsed:.2f} s", err=True)


def echo_logprobs(tokenizer: Any, logprobs: list[TokenLogprobs]) -> None:
    """One line per token: its text, logprob, rank and the most likely tokens'; a blank after."""
    for lp in logprobs:
        top = ", ".join(f"{tokenizer.decode([t])!r} {v:.3f}" for t, v in lp.top)
        token = tokenizer.decode([lp.token_id])
        click.echo(f"  {token!r} {lp.logprob:.3f} (rank {lp.rank})" + (f"  [{top}]" if top else ""))
    click.echo("")


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
@click.option(
    "--self-prompts",
    default=0,
    show_default=True,
    type=int,
    help="Prompts the target writes itself (Magpie) and answers, beside --data's.",
)
@click.option("--max-steps", default=1500, show_default=True, type=int)
@click.option(
    "--max-train-tokens",
    default=200_000,
    show_default=True,
    type=int,
    help="Answered corpus: prompt + response tokens the target writes.",
)
@click.option(
    "--unanswered/--answered-only",
    default=True,
    show_default=True,
    help="Keep the prompts left over past --max-train-tokens, without a response.",
)
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=float,
    help="Of the target's answers (0: greedy); sampled answers are more distinct text.",
)
@click.option(
    "--init-from",
    default=None,
    help="Heads to start from (e.g. the shipped ones, to train on further), unless resuming.",
)
@click.option("--batch-tokens", default=4096, show_default=True, type=int)
@click.option("--lr", default=1e-3, show_default=True, type=float)
@click.option("--draft-vocab-size", default=8192, show_default=True, type=int)
@click.option("--num-heads", default=4, show_default=True, type=int, help="medusa's heads.")
@click.option("--save-every", default=250, show_default=True, type=int)
@click.option(
    "--mixed-precision",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "bf16", "no"]),
    help="bf16 autocast for the heads' matmuls (auto: where the CPU or GPU has bf16 units).",
)
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


def _split(value: str | None, kind: type = str) -> tuple[Any, ...] | None:
    if not value:
        return None
    try:
        return tuple(kind(v.strip()) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated {kind.__name__}s, got {value!r}"
        ) from None


@main.command()
@click.option("--model", default=None, help="The target (default: the embedded SmolLM2-135M).")
@click.option(
    "--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"])
)
@click.option("--dataset", default=None, help="Spec-Bench-format JSONL (default: ours).")
@click.option("--categories", default=None, help="Comma-separated (default: all in the dataset).")
@click.option("--questions-per-category", type=int, default=None, help="Default: all.")
@click.option(
    "--max-new-tokens",
    default=None,
    type=int,
    help="Per turn (default: each question's max_tokens, else 128; --quick: 32).",
)
@click.option(
    "--max-turns", default=None, type=int, help="Turns played per question (default: all)."
)
@click.option(
    "--drafters",
    default=None,
    help="Comma-separated (default: every one available); NAME+lookup runs NAME with prompt lookup first (lookup_first=2).",
)
@click.option("--k", "ks", default="8", show_default=True, help="k to try, comma-separated.")
@click.option(
    "--adaptive/--fixed-k",
    default=True,
    show_default=True,
    help="Let the policy draft fewer than k where drafting does not pay.",
)
@click.option("--draft-model", default=None, help="A draft model, for draft_model.")
@click.option("--eagle-heads", default=None, help="EAGLE heads (default: the shipped ones).")
@click.option("--medusa-heads", default=None, help="Medusa heads (default: the shipped ones).")
@click.option(
    "--modes",
    default="offline,load",
    show_default=True,
    help="Comma-separated, of offline, load, runtime, kernels, wrap, quant, embed, lora, guided.",
)
@click.option("--no-hf", is_flag=True, help="Skip transformers generate.")
@click.option("--no-peers", is_flag=True, help="Skip llama.cpp.")
@click.option("--rates", default=None, help="Requests/s, comma-separated (default: relative).")
@click.option("--requests-per-rate", default=16, show_default=True, type=int)
@click.option("--load-max-tokens", default=64, show_default=True, type=int)
@click.option("--url", default=None, help="Load a running specdec serve instead.")
@click.option("--api-key", envvar="SPECDEC_API_KEY", default=None)
@click.option("--out", default="eval/results/bench", show_default=True)
@click.option("--quick", is_flag=True, help="1 question per category, short outputs.")
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=float,
    help="0: greedy; else every system samples, each turn seeded alike on every engine.",
)
@click.option("--top-p", default=1.0, show_default=True, type=float, help="With --temperature.")
@click.option("--seed", default=0, show_default=True, type=int)
def bench(
    categories: str | None,
    drafters: str | None,
    ks: str,
    eagle_heads: str | None,
    medusa_heads: str | None,
    modes: str,
    no_hf: bool,
    no_peers: bool,
    rates: str | None,
    dataset: str | None,
    **options: Any,
) -> None:
    """Which drafter, with which k, makes this workload faster, alone and under load: a
    report (bench.json, bench.md, plots in --out) and a recommendation."""
    from specdec.eval.bench import BenchConfig, report, run_bench

    heads = {k: v for k, v in (("eagle", eagle_heads), ("medusa", medusa_heads)) if v}
    if dataset:
        options["dataset"] = dataset
    try:
        config = BenchConfig(
            categories=_split(categories),
            drafters=_split(drafters),
            ks=_split(ks, int) or (8,),
            heads=heads,
            modes=_split(modes) or (),
            with_hf=not no_hf,
            peers=not no_peers,
            rates=_split(rates, float),
            **options,
        )
        result = run_bench(config)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(report.markdown(result))
    click.echo(f"results: {config.out}/bench.json, bench.md, " + ", ".join(result["plots"]))
    if result["failed"]:
        raise click.ClickException("a drafter's output differs from plain decoding")


main.add_command(serve)

if __name__ == "__main__":
    sys.exit(main())
