"""Command-line options of ``specdec generate`` and ``specdec serve``."""

from __future__ import annotations

import json
from typing import Any

import click

from specdec.drafters.registry import DRAFTERS, SpecConfig
from specdec.lora import LoRARequest
from specdec.models.quant import QUANTIZATIONS


def guide_options(fn: Any) -> Any:
    """``--choice``, ``--regex``, ``--json-schema``, ``--grammar`` and ``--structural-tag`` (of
    ``generate``)."""
    for name, help in (
        (
            "--structural-tag",
            "free text with tagged structures in it, as this structural tag (vLLM's JSON, or "
            "@FILE) says.",
        ),
        ("--grammar", "a string this EBNF or Lark grammar derives (its text, or @FILE)."),
        ("--json-schema", "JSON that this JSON Schema accepts (its text, or @FILE)."),
        ("--regex", "match this regular expression."),
    ):
        fn = click.option(name, default=None, help=f"Make the output {help}")(fn)
    help = "Make the output one of these strings (repeat the option for each choice)."
    return click.option("--choice", multiple=True, help=help)(fn)


def read_guides(sampling: dict[str, Any]) -> None:
    """The guide options as SamplingParams takes them: choices as a list (None if none), a
    schema, grammar or structural tag given as @FILE read from the file."""
    sampling["choice"] = list(sampling["choice"]) or None
    for key in ("json_schema", "grammar", "structural_tag"):
        if (sampling[key] or "").startswith("@"):
            with open(sampling[key][1:], encoding="utf-8") as f:
                sampling[key] = f.read()


def model_options(fn: Any) -> Any:
    """``--model``, ``--dtype``, ``--device``, ``--cuda-graphs``, ``--quantization`` and
    ``--batch-invariant``."""
    fn = click.option(
        "--cuda-graphs",
        is_flag=True,
        help="CUDA: replay decode and verification steps as captured CUDA graphs.",
    )(fn)
    fn = click.option(
        "--device",
        default="auto",
        show_default=True,
        help="auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N.",
    )(fn)
    fn = click.option(
        "--quantization",
        default=None,
        type=click.Choice(list(QUANTIZATIONS)),
        help="Quantized linears: int8/int4 weight-only (int4: the output layer in int8), "
        "w8a8/w4a8 the same weights with int8 activations (faster, not the weights' exact "
        "function); a GGUF file's Q4_1/Q8_0 weights are used as they are (default: none).",
    )(fn)
    fn = click.option(
        "--batch-invariant/--no-batch-invariant",
        default=None,
        help="Kernels whose results do not depend on the batch, so that speculation gives "
        "exactly plain decoding's tokens and logprobs (default: on where the CPU kernels "
        "are vector code, AVX-512 or AVX2).",
    )(fn)
    fn = click.option(
        "--dtype",
        default="float32",
        type=click.Choice(["float32", "bfloat16", "auto"]),
        show_default=True,
        help="Activations and unquantized weights; auto: the model's own (float16 runs as "
        "bfloat16; a GGUF file as float32).",
    )(fn)
    return click.option(
        "--model",
        default=None,
        help="HF model directory or GGUF file (default: the embedded SmolLM2-135M-Instruct).",
    )(fn)


def speculation_options(fn: Any) -> Any:
    """The drafter options shared by ``generate`` and ``serve``."""
    fn = click.option(
        "--drafter",
        default="none",
        show_default=True,
        type=click.Choice(["none", *DRAFTERS]),
        help="Who proposes draft tokens (none: plain decoding; quantized_self: the target's own "
        "weights, quantized; eagle/medusa: trained heads on the target's hidden states).",
    )(fn)
    fn = click.option(
        "--draft-quantization",
        default=None,
        type=click.Choice(list(QUANTIZATIONS)),
        help="quantized_self's weights (default: w4a8 with AVX-512 VNNI or AVX2, else int4).",
    )(fn)
    fn = click.option(
        "--draft-model", default=None, help="HF directory or GGUF file of the draft model."
    )(fn)
    fn = click.option(
        "--heads",
        default=None,
        help="eagle/medusa: a directory of heads from `specdec train-heads` (default: the "
        "heads shipped for the default model).",
    )(fn)
    fn = click.option(
        "--lookup-first",
        default=None,
        type=int,
        help="With a drafter that has a model: draft by prompt lookup instead wherever the "
        "last N or more tokens occurred earlier in the prompt or output (free drafts where the "
        "answer copies its prompt).",
    )(fn)
    fn = click.option(
        "--num-speculative-tokens",
        default=8,
        show_default=True,
        type=int,
        help="Most drafts per sequence and step (k); the adaptive policy may use fewer.",
    )(fn)
    return fn


def spec_config(drafter: str, num_speculative_tokens: int, **options: Any) -> SpecConfig | None:
    """The ``speculative=`` argument of ``LLM`` for the CLI options (None: no speculation);
    ``options`` are the drafter options given on the command line (None: not given)."""
    if drafter == "none":
        return None
    given = {name: value for name, value in options.items() if value is not None}
    try:
        return SpecConfig(drafter, num_speculative_tokens, **given)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def lora_module(value: str, lora_id: int) -> LoRARequest:
    """One ``--lora-modules`` value, ``name=path`` or a JSON object with ``name`` and ``path``
    (vLLM's two forms), as the adapter with id ``lora_id``; a usage error that says why not."""
    hint = "--lora-modules"
    if value.lstrip().startswith("{"):
        try:
            fields = json.loads(value)
            name, path = fields["name"], fields["path"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise click.BadParameter(
                f"{value!r}: not JSON with name and path", param_hint=hint
            ) from e
    else:
        name, sep, path = value.partition("=")
        if not sep:
            raise click.BadParameter(f"{value!r}: give name=path", param_hint=hint)
    try:
        return LoRARequest(name, lora_id, path)
    except ValueError as e:
        raise click.BadParameter(f"{value!r}: {e}", param_hint=hint) from e
