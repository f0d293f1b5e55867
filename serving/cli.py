"""``specdec serve``: the OpenAI-compatible server on the command line.

The command is a standalone ``click.Command``; ``specdec/cli.py`` registers it on the ``specdec``
group with ``main.add_command(serve)``.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from pathlib import Path
from typing import Any

import click
import uvicorn

from specdec.cli_options import lora_module, model_options, spec_config, speculation_options
from specdec.engine_config import POOLING_TYPES, SCHEDULING_POLICIES
from specdec.serving.reasoning import REASONING_PARSERS
from specdec.serving.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@click.command()
@model_options
@speculation_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--api-key",
    envvar="SPECDEC_API_KEY",
    show_envvar=True,
    default=None,
    help="Require `Authorization: Bearer KEY` on /v1/... (default: no key).",
)
@click.option(
    "--max-concurrent",
    default=256,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most sequences on the engine at once (a request holds prompts x n).",
)
@click.option(
    "--max-queue",
    default=1024,
    show_default=True,
    type=click.IntRange(min=0),
    help="Most requests waiting for room; beyond, 503 with Retry-After.",
)
@click.option(
    "--max-stop-strings",
    default=64,
    show_default=True,
    type=click.IntRange(min=0),
    help="Most stop strings (and stop token ids) per request; beyond, 400.",
)
@click.option(
    "--max-stop-chars",
    default=256,
    show_default=True,
    type=click.IntRange(min=1),
    help="Longest stop string, in characters; beyond, 400.",
)
@click.option(
    "--metrics-require-key",
    is_flag=True,
    help="Put /metrics behind --api-key too (by default it is open, as in vLLM).",
)
@click.option(
    "--enable-auto-tool-choice",
    is_flag=True,
    help='Take tool_choice "auto" (the default with tools): needs --tool-call-parser.',
)
@click.option(
    "--tool-call-parser",
    type=click.Choice(TOOL_CALL_PARSERS),
    default=None,
    help='The model\'s tool-call syntax, read under tool_choice "auto" (see the README).',
)
@click.option(
    "--openapi",
    is_flag=True,
    help="Serve the OpenAPI schema at /openapi.json (behind --api-key, if set).",
)
@click.option(
    "--return-tokens-as-token-ids",
    is_flag=True,
    help='Logprobs name each token "token_id:<id>" (a request\'s return_tokens_as_token_ids '
    "overrides it), so clients read exact ids (vLLM's flag).",
)
@click.option(
    "--responses-store",
    default=0,
    show_default=True,
    type=int,
    help="Keep the last N responses of the Responses API in memory, for previous_response_id "
    "and GET/DELETE /v1/responses/{id} (0: none are stored).",
)
@click.option(
    "--reasoning-parser",
    type=click.Choice(REASONING_PARSERS),
    default=None,
    help="Split a reasoning model's <think> block from its chat reply into `reasoning` "
    "(DeepSeek-R1 and its distills: deepseek_r1; Qwen3: qwen3).",
)
@click.option(
    "--chat-template",
    default=None,
    help="A Jinja chat template (a file, or the template itself) instead of the tokenizer's.",
)
@click.option(
    "--trust-request-chat-template",
    is_flag=True,
    help="Let a request bring its own chat_template (refused with 400 otherwise).",
)
@click.option("--served-model-name", default=None, help="Name clients send as `model`.")
@click.option("--max-model-len", default=None, type=int, help="Longest prompt + output.")
@click.option("--max-num-seqs", default=64, show_default=True, type=int, help="Batch size cap.")
@click.option("--kv-cache-memory-gb", default=1.0, show_default=True, type=float)
@click.option(
    "--num-kv-blocks",
    "--num-gpu-blocks-override",
    "num_kv_blocks",
    default=None,
    type=int,
    help="The KV pool's size in blocks, instead of --kv-cache-memory-gb (vLLM's second name).",
)
@click.option("--block-size", default=16, show_default=True, type=int, help="Tokens per KV block.")
@click.option(
    "--max-num-batched-tokens",
    default=1024,
    show_default=True,
    type=int,
    help="A step's token budget (prompt chunks and decodes); longer prompts are chunked.",
)
@click.option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    default=True,
    show_default=True,
    help="Reuse the KV blocks of prompts' common prefixes across requests.",
)
@click.option(
    "--scheduling-policy",
    type=click.Choice(SCHEDULING_POLICIES),
    default="fcfs",
    show_default=True,
    help="priority: requests' `priority` field orders the waiting line (lower first) and picks "
    "whom to preempt (vLLM's); fcfs: arrival order, and any priority but 0 is refused.",
)
@click.option(
    "--pooling-type",
    type=click.Choice(POOLING_TYPES),
    default="last",
    show_default=True,
    help="How /v1/embeddings pools a prompt's final hidden states: the last token's, their "
    "mean, or the first token's (vLLM's pooler_config pooling_type).",
)
@click.option(
    "--gpu-memory-utilization",
    default=0.9,
    show_default=True,
    type=float,
    help="CUDA: the share of GPU memory the engine may hold; the KV pool takes what is left.",
)
@click.option(
    "--seed",
    default=None,
    type=int,
    help="Requests without a seed draw theirs from a generator seeded with this, so a restarted "
    "server repeats the same requests' samples (vLLM's --seed; default: unseeded).",
)
@click.option(
    "--generation-config",
    default="auto",
    show_default=True,
    help="Default sampling parameters of requests that leave them unset: auto (the model's "
    "generation_config.json), vllm (none: the neutral ones) or a directory holding one.",
)
@click.option(
    "--override-generation-config",
    default=None,
    help="JSON laid over the generation config's sampling fields, e.g. '{\"temperature\": 0.5}'.",
)
@click.option("--enable-lora", is_flag=True, help="Serve LoRA adapters (see --lora-modules).")
@click.option(
    "--lora-modules",
    multiple=True,
    help="A LoRA adapter served under its own name, as name=path or JSON "
    '\'{"name": ..., "path": ...}\'; repeat for more (needs --enable-lora).',
)
@click.option("--max-loras", default=1, show_default=True, help="Most adapters in one step.")
@click.option("--max-lora-rank", default=16, show_default=True, help="Highest adapter rank.")
@click.option(
    "--max-cpu-loras", default=None, type=int, help="Adapters kept loaded [default: max-loras]."
)
@click.option(
    "--draft-lora",
    is_flag=True,
    help="quantized_self drafts through each request's LoRA adapter too (see the README).",
)
@click.option(
    "--allow-runtime-lora-updating",
    is_flag=True,
    envvar="VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    help="Serve /v1/load_lora_adapter and /v1/unload_lora_adapter (also with vLLM's "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).",
)
@click.option(
    "--lora-resolver-dir",
    default=None,
    envvar="VLLM_LORA_RESOLVER_CACHE_DIR",
    help="With --allow-runtime-lora-updating: a request naming an unknown model loads the "
    "adapter in DIR/<model> (vLLM's filesystem resolver; also VLLM_LORA_RESOLVER_CACHE_DIR).",
)
@click.option("--log-level", default="info", show_default=True)
def serve(
    model: str | None,
    dtype: str,
    quantization: str | None,
    batch_invariant: bool | None,
    device: str,
    cuda_graphs: bool,
    drafter: str,
    draft_model: str | None,
    num_speculative_tokens: int,
    draft_quantization: str | None,
    heads: str | None,
    lookup_first: int | None,
    host: str,
    port: int,
    api_key: str | None,
    max_concurrent: int,
    max_queue: int,
    max_stop_strings: int,
    max_stop_chars: int,
    metrics_require_key: bool,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
    openapi: bool,
    return_tokens_as_token_ids: bool,
    responses_store: int,
    reasoning_parser: str | None,
    chat_template: str | None,
    trust_request_chat_template: bool,
    served_model_name: str | None,
    max_model_len: int | None,
    max_num_seqs: int,
    kv_cache_memory_gb: float,
    num_kv_blocks: int | None,
    block_size: int,
    max_num_batched_tokens: int,
    enable_prefix_caching: bool,
    scheduling_policy: str,
    pooling_type: str,
    gpu_memory_utilization: float,
    seed: int | None,
    generation_config: str,
    override_generation_config: str | None,
    enable_lora: bool,
    lora_modules: tuple[str, ...],
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int | None,
    draft_lora: bool,
    allow_runtime_lora_updating: bool,
    lora_resolver_dir: str | None,
    log_level: str,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/responses, /v1/embeddings, and vLLM's /score and /rerank)."""
    from specdec.llm import LLM
    from specdec.serving.app import ServerConfig, build_app

    try:
        config = ServerConfig(
            served_model_name=served_model_name,
            api_key=api_key,
            max_concurrent=max_concurrent,
            max_queue=max_queue,
            max_stop_strings=max_stop_strings,
            max_stop_chars=max_stop_chars,
            openapi=openapi,
            metrics_require_key=metrics_require_key,
            enable_auto_tool_choice=enable_auto_tool_choice,
            tool_call_parser=tool_call_parser,
            return_tokens_as_token_ids=return_tokens_as_token_ids,
            responses_store=responses_store,
            chat_template=read_chat_template(chat_template),
            trust_request_chat_template=trust_request_chat_template,
            reasoning_parser=reasoning_parser,
            lora_modules=[lora_module(value, i + 1) for i, value in enumerate(lora_modules)],
            allow_runtime_lora_updating=allow_runtime_lora_updating,
            lora_resolver_dir=lora_resolver_dir,
        )
        llm = LLM(
            model,
            dtype=dtype,
            quantization=quantization,
            batch_invariant=batch_invariant,
            device=device,
            cuda_graphs=cuda_graphs,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            kv_cache_memory_gb=kv_cache_memory_gb,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            scheduling_policy=scheduling_policy,
            pooling_type=pooling_type,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            generation_config=generation_config,
            override_generation_config=_json_object(override_generation_config),
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            speculative=spec_config(
                drafter,
                num_speculative_tokens,
                draft_model=draft_model,
                draft_quantization=draft_quantization,
                draft_lora=draft_lora or None,  # an option of quantized_self's only
                heads=heads,
                lookup_first=lookup_first,
            ),
        )
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    if api_key is None and not _is_loopback(host):
        click.echo(f"warning: serving on {host} with no --api-key: anyone can use it", err=True)
    try:
        app = build_app(llm, config)
    except ValueError as e:  # an adapter the engine refuses
        raise click.ClickException(str(e)) from e
    click.echo(f"serving {llm.model_name} at http://{host}:{port}/v1", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


def _json_object(value: str | None) -> dict[str, Any] | None:
    """``--override-generation-config``: a JSON object, or a usage error that says why not."""
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        hint = "--override-generation-config"
        raise click.BadParameter(f"not JSON: {e}", param_hint=hint) from e
    if not isinstance(parsed, dict):
        raise click.BadParameter(
            f"must be a JSON object, got {value!r}", param_hint="--override-generation-config"
        )
    return parsed


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template given inline (vLLM reads it the
    same way); a value that is neither is a usage error."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise click.BadParameter(
        f"{value!r} is neither a file nor a Jinja template", param_hint="--chat-template"
    )


if __name__ == "__main__":
    serve()
