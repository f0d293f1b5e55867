"""The HTTP routes: completions, chat completions, models, tokenize, health and metrics.

A generation route checks the model name and the stop strings, tokenizes (raw prompts for
completions, the chat template for chat), turns the body into one :class:`GenerationRequest` per
choice and runs them as a :class:`Generation`: streamed as server-sent events, or collected into
one response. Templates are rendered and prompts tokenized in worker threads, never on the event
loop, and a prompt text too long to fit the context is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.background import BackgroundTask

from specdec.llm import ChatOptions
from specdec.serving.adapters import adapter_of, resolve_adapter, served_name
from specdec.serving.beams import BeamGeneration, check_beam_request
from specdec.serving.bridge import GenerationRequest
from specdec.serving.errors import APIError
from specdec.serving.generation import Generation, server_sent_events, until_disconnected
from specdec.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
)
from specdec.serving.reasoning import guide_after, reasoning_split
from specdec.serving.render import (
    ResponseMeta,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
)
from specdec.serving.responses import (
    ModelCard,
    ModelList,
)
from specdec.serving.tool_parsers import CallParser, parser_for, tool_schemas
from specdec.serving.tools import strict_calls

if TYPE_CHECKING:
    from specdec.serving.app import ServerState
    from specdec.serving.responses_api import ResponsesRequest as ResponsesBody

router = APIRouter()
CLIENT_CLOSED_REQUEST = 499  # the status logged for a request whose client went away


def server_state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/health")
async def health(request: Request) -> Response:
    state = server_state(request)
    if not state.engine.is_running:
        error = state.engine.error or "not started"
        return APIError(503, f"The engine is not running: {error}", "server_error").response()
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def version() -> JSONResponse:
    """specdec's version (vLLM's ``/version``)."""
    from specdec import __version__

    return JSONResponse({"version": __version__})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    state = server_state(request)
    return ModelList(data=[_card(state, name) for name in (state.model_name, *state.loras)])


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> ModelCard:
    """The served model's card (OpenAI's ``models.retrieve``); 404 for any other name."""
    state = server_state(request)
    await check_model(state, model_id)
    return _card(state, model_id)


def _card(state: ServerState, name: str) -> ModelCard:
    """The served model's card, or a LoRA adapter's (its ``parent`` the served model)."""
    max_model_len, lora = state.llm.engine.max_model_len, state.loras.get(name)
    return ModelCard(
        id=name,
        created=state.created,
        max_model_len=max_model_len,
        root=state.model_name if lora is None else lora.path,
        parent=None if lora is None else state.model_name,
    )


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    await check_model(state, body.model)
    check_stops(state, body)
    show_prompt_logprobs = check_prompt_logprobs(body)
    if body.requested_max_tokens == 0 and not body.echo:
        message = "max_tokens may be 0 only with echo set to true (to score the prompt alone)"
        raise APIError(400, message, param="max_tokens")
    truncate = body.truncate_prompt_tokens
    if body.use_beam_search:
        check_beam_request(body)
    prompts = [await tokenize(state, prompt, "prompt", truncate) for prompt in body.prompt]
    generation = make_generation(state, body, prompts, "prompt")
    echo = None
    if body.echo:  # each choice's text starts with its prompt's (token ids, or truncated: decoded)
        texts = [
            p
            if isinstance(p, str) and truncate is None
            else await asyncio.to_thread(state.llm.decode, ids)
            for p, ids in zip(body.prompt, prompts)
        ]
        echo = [text for text in texts for _ in range(body.n or 1)]
    meta = ResponseMeta(
        "cmpl",
        served_name(state, body.model),
        echo=echo,
        prompt_logprobs=show_prompt_logprobs,
        token_ids=as_token_ids(state, body),
        continuous_usage=body.continuous_usage,
    )
    full = partial(completion_response, generation, meta)
    chunks = partial(completion_chunks, generation, meta, body.include_usage)
    return await respond(request, generation, bool(body.stream), full, chunks)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    await check_model(state, body.model)
    check_stops(state, body)
    show_prompt_logprobs = check_prompt_logprobs(body)
    if body.use_beam_search:
        check_beam_request(body)
    names = auto_tools(state, body)
    text = await render_chat(state, body.conversation(), body.chat_options())
    prompt = await tokenize(state, text, "messages", body.truncate_prompt_tokens)
    split = reasoning_split(state.config.reasoning_parser, body, text)
    generation = make_generation(state, body, [prompt], "messages", guide_after(split, body))
    echoed = body.echoed_text()
    echo = None if echoed is None else [echoed] * len(generation.choices)
    meta = ResponseMeta(
        "chatcmpl",
        served_name(state, body.model),
        echo=echo,
        prompt_logprobs=show_prompt_logprobs,
        tool_choice=body.tool_choice if body.calls_tools else None,
        auto_tools=names,
        reasoning=split,
        token_ids=as_token_ids(state, body),
        continuous_usage=body.continuous_usage,
    )
    full = partial(chat_response, generation, meta)
    chunks = partial(chat_chunks, generation, meta, body.include_usage)
    return await respond(request, generation, bool(body.stream), full, chunks)


async def check_model(state: ServerState, model: str | None) -> None:
    """404 for a ``model`` that is neither the served model nor one of its LoRA adapters (nor
    one the resolver finds: see adapters.py)."""
    if model is None or model == state.model_name or model in state.loras:
        return
    if not await resolve_adapter(state, model):
        served = ", ".join(f"`{name}`" for name in (state.model_name, *state.loras))
        raise APIError(
            404,
            f"The model `{model}` does not exist: this server serves {served}",
            param="model",
            code="model_not_found",
        )


def auto_tools(
    state: ServerState, body: ChatCompletionRequest | ResponsesBody
) -> CallParser | None:
    """The parser of the calls, for the request's tools, when the model decides whether to call
    them (tool_choice "auto", the default with tools), else None; 400 where the server has no
    parser for its calls. A syntax whose marker is a special token keeps special tokens in the
    reply's text."""
    if not body.auto_tools:
        return None
    if not state.config.enable_auto_tool_choice:
        raise APIError(
            400,
            'tool_choice is "auto" (the default with tools), which needs a parser of the '
            "model's own tool-call syntax: start the server with --enable-auto-tool-choice "
            "--tool-call-parser (hermes, mistral, llama3_json, pythonic or qwen3_coder), or "
            'set it to "required", "none" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    parser = parser_for(state.config.tool_call_parser or "hermes", tool_schemas(body.chat_tools()))
    if parser.syntax.special_tokens and body.skip_special_tokens is None:
        body.skip_special_tokens = False
    if parser.syntax.strict is not None and not body.guide():  # strict tools: see tools.py
        body.guide_tools(strict_calls(body.chat_tools(), parser.syntax.strict))
    return parser


def check_prompt_logprobs(body: GenerationFields) -> bool:
    """Whether to show prompt_logprobs; 400 when asked for in a stream (as vLLM refuses it)."""
    if body.prompt_logprobs is not None and body.stream:
        message = "prompt_logprobs is not available when stream is true: leave one of them unset"
        raise APIError(400, message, param="prompt_logprobs")
    return body.prompt_logprobs is not None


def check_stops(state: ServerState, body: GenerationFields) -> None:
    """400 for more stop strings or stop token ids, or longer stop strings, than the server takes."""
    config = state.config
    for param, values in (("stop", body.stop), ("stop_token_ids", body.stop_token_ids)):
        if values is not None and len(values) > config.max_stop_strings:
            raise APIError(
                400,
                f"{param} has {len(values)} entries, but this server takes at most "
                f"{config.max_stop_strings}",
                param=param,
            )
    longest = max((len(s) for s in body.stop or []), default=0)
    if longest > config.max_stop_chars:
        raise APIError(
            400,
            f"stop has a string of {longest} characters, but this server takes stop strings of "
            f"at most {config.max_stop_chars}",
            param="stop",
        )


async def render_chat(
    state: ServerState,
    conversation: list[dict[str, str]],
    options: ChatOptions,
    param: str = "messages",
) -> str:
    """The conversation through the chat template (the request's own, where the server trusts
    requests with one; else the server's), in a worker thread; 400 (naming ``param``) if it
    refuses."""
    if options.chat_template is not None and not state.config.trust_request_chat_template:
        raise APIError(
            400,
            "this server takes no chat_template from requests: start it with "
            "--trust-request-chat-template to allow them, or --chat-template to set one for all",
            param="chat_template",
        )
    if options.chat_template is None and state.config.chat_template is not None:
        options = dataclasses.replace(options, chat_template=state.config.chat_template)
    try:
        return await asyncio.to_thread(state.llm.render_chat, conversation, options)
    except (ValueError, jinja2.TemplateError) as e:
        message = f"The chat template refused the {param}: {e}"
        raise APIError(400, message, param=param) from e


async def tokenize(
    state: ServerState, prompt: str | list[int], param: str, truncate: int | None = None
) -> list[int]:
    """The prompt's token ids, tokenized in a worker thread, the last ``truncate`` of them
    where it is set (the request's ``truncate_prompt_tokens``); else 400 for a text that cannot
    fit."""
    if truncate is not None:
        ids = (
            prompt
            if isinstance(prompt, list)
            else await asyncio.to_thread(state.llm.encode, prompt)
        )
        return ids[-state.llm.engine.prompt_limit(truncate) :]
    if isinstance(prompt, str) and len(prompt) > state.max_prompt_chars:
        max_model_len = state.llm.engine.max_model_len
        raise APIError(
            400,
            f"The {param} is too long: {len(prompt)} characters cannot fit the context of "
            f"{max_model_len} tokens (this tokenizer needs more tokens than that for any text "
            f"over {state.max_prompt_chars} characters)",
            param=param,
            code="context_length_exceeded",
        )
    return await asyncio.to_thread(state.llm.encode, prompt)


def as_token_ids(state: ServerState, body: GenerationFields) -> bool:
    """Whether the response's logprobs name tokens by id: the request says, else the server."""
    if body.return_tokens_as_token_ids is not None:
        return body.return_tokens_as_token_ids
    return state.config.return_tokens_as_token_ids


def make_generation(
    state: ServerState,
    body: GenerationFields,
    prompts: list[list[int]],
    prompt_param: str,
    guide_fields: dict[str, Any] | None = None,
) -> Generation:
    """One request per prompt and choice (prompt-major), with max_tokens fitted to the context
    (``max_tokens`` 0, allowed with echo, generates one token that the generation drops); with
    ``use_beam_search``, a beam search per prompt (specdec/serving/beams.py). ``guide_fields``:
    where the guide starts (a reasoning model's thinking first, see reasoning.py)."""
    max_model_len, defaults = state.llm.engine.max_model_len, state.llm.sampling_defaults
    check_priority_allowed(state, body.priority)
    fit = partial(fit_max_tokens, body, max_model_len=max_model_len, cap=defaults.get("max_tokens"))
    if body.use_beam_search:
        limits = [max(1, fit(len(p))) for p in prompts]
        return BeamGeneration(state, body, prompts, limits, prompt_param)
    requests, lora = [], adapter_of(state, body.model)
    for prompt in prompts:
        max_tokens = fit(len(prompt))
        for choice in range(body.n or 1):
            try:
                params = body.sampling_params(max(max_tokens, 1), choice, defaults)
                params = dataclasses.replace(params, **(guide_fields or {}))
            except ValueError as e:
                raise APIError(400, str(e), param=body.param_of(str(e).split(" ")[0])) from e
            requests.append(
                GenerationRequest(prompt, params, body.num_speculative_tokens, body.priority, lora)
            )
    num_prompt_tokens = sum(len(p) for p in prompts)
    discard = body.requested_max_tokens == 0
    return Generation(
        state, requests, num_prompt_tokens, prompt_param, discard, guide_param=body.guide_field()
    )


def check_priority_allowed(state: ServerState, priority: int) -> None:
    """400 for a priority other than 0 on a server that schedules first come first served."""
    if priority and not state.llm.engine.scheduler.by_priority:
        raise APIError(
            400,
            f"priority {priority} needs priority scheduling: the server was started without "
            "--scheduling-policy priority, so every request must have priority 0",
            param="priority",
        )


def fit_max_tokens(
    body: GenerationFields, num_prompt_tokens: int, max_model_len: int, cap: int | None = None
) -> int:
    """The request's max_tokens, or what is left of the context; 400 if it does not fit. ``cap``
    (the generation config's ``max_new_tokens``) bounds either, as vLLM bounds them."""
    requested = body.requested_max_tokens
    room = max_model_len - num_prompt_tokens
    if room < 1:  # the engine refuses the prompt itself, with its own message
        return requested or 1
    if requested is None:
        return room if cap is None else min(room, cap)
    if requested > room:
        param = body.max_tokens_param
        raise APIError(
            400,
            f"{param} is too large: the context holds {max_model_len} tokens and the prompt "
            f"has {num_prompt_tokens}, so at most {room} can be generated; you asked for "
            f"{requested}",
            param=param,
            code="context_length_exceeded",
        )
    return requested if cap is None else min(requested, cap)


async def respond(
    request: Request,
    generation: Generation,
    stream: bool,
    full: Callable[[], BaseModel],
    chunks: Callable[[], AsyncIterator[BaseModel]],
) -> Response:
    """Start ``generation``, then stream its chunks or wait and send ``full()``."""
    if await until_disconnected(request, generation.start()) is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if stream:
        return StreamingResponse(
            server_sent_events(generation, chunks()),
            media_type="text/event-stream",
            background=BackgroundTask(generation.aclose),
        )
    try:
        finished = await until_disconnected(request, generation.run())
    finally:
        generation.close()
    if finished is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return Response(full().model_dump_json(), media_type="application/json")
