"""The FastAPI application: configuration, shared state, middleware and lifespan.

``build_app(llm, config)`` returns an ASGI app that owns ``llm`` while it runs: its lifespan starts
the engine thread (:class:`~specdec.serving.bridge.AsyncEngine`) and stops it on shutdown.
Run it with uvicorn (``specdec serve``), or in a background thread with
:class:`~specdec.serving.server.BackgroundServer`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI

from specdec.llm import LLM
from specdec.lora import LoRARequest
from specdec.serving.adapters import router as adapters_router
from specdec.serving.adapters import serve_adapters
from specdec.serving.bridge import AsyncEngine
from specdec.serving.embeddings import router as embeddings_router
from specdec.serving.errors import UnexpectedErrors, install_error_handlers
from specdec.serving.limits import (
    AdmissionGate,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    max_prompt_chars,
)
from specdec.serving.logprobs import TokenTexts
from specdec.serving.metrics import RequestCountMiddleware, ServerMetrics
from specdec.serving.reasoning import REASONING_PARSERS
from specdec.serving.responses_api import router as responses_router
from specdec.serving.responses_store import ResponseStore
from specdec.serving.routes import router
from specdec.serving.sagemaker import router as sagemaker_router
from specdec.serving.scores import router as scores_router
from specdec.serving.tokenization import router as tokenization_router
from specdec.serving.tool_parsers import TOOL_CALL_PARSERS


@dataclass(slots=True)
class ServerConfig:
    """How the HTTP server behaves; the engine itself is configured on the ``LLM``."""

    served_model_name: str | None = None  # the name clients send as `model`; None: the LLM's
    api_key: str | None = None  # if set, /v1/... needs `Authorization: Bearer <api_key>`
    max_concurrent: int = 256  # most sequences on the engine at once (prompts x n per request)
    max_queue: int = 1024  # most requests waiting for room; beyond, 503 with Retry-After
    max_body_bytes: int = 4 * 2**20  # larger request bodies get 413
    retry_after_s: int = 1  # the Retry-After of a 503
    max_stop_strings: int = 64  # most stop strings (and stop token ids) per request; beyond, 400
    max_stop_chars: int = 256  # longest stop string, in characters; beyond, 400
    openapi: bool = False  # serve the OpenAPI schema at /openapi.json (behind the key, if set)
    metrics_require_key: bool = False  # put /metrics behind the API key too
    # tool_choice "auto" (vLLM's --enable-auto-tool-choice): the model decides whether to call,
    # and tool_call_parser (see tool_parsers.py: "hermes", "mistral", ...) finds its calls
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # every request's logprobs name tokens "token_id:<id>" (vLLM's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool = False
    # the Responses API keeps this many finished responses (0: none), for previous_response_id
    # and GET/DELETE /v1/responses/{id} (see responses_store.py)
    responses_store: int = 0
    # a Jinja chat template instead of the tokenizer's (vLLM's --chat-template), and whether a
    # request may bring its own (--trust-request-chat-template)
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    # chat replies' thinking split from their answer (vLLM's --reasoning-parser; see
    # reasoning.py): "deepseek_r1" or "qwen3"; None: the reply is all content
    reasoning_parser: str | None = None
    # LoRA adapters served by name (vLLM's --lora-modules; the LLM needs enable_lora), and
    # whether /v1/load_lora_adapter and /v1/unload_lora_adapter may change them while serving
    lora_modules: list[LoRARequest] = field(default_factory=list)
    allow_runtime_lora_updating: bool = False
    # with allow_runtime_lora_updating: a request naming an unknown model loads the adapter in
    # this directory's subdirectory of that name (vLLM's filesystem resolver; adapters.py)
    lora_resolver_dir: str | None = None

    def __post_init__(self) -> None:
        names = ("max_concurrent", "max_body_bytes", "retry_after_s", "max_stop_chars")
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_queue", "max_stop_strings", "responses_store"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.lora_resolver_dir is not None and not self.allow_runtime_lora_updating:
            raise ValueError("lora_resolver_dir needs allow_runtime_lora_updating")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset for an open server)")
        if self.metrics_require_key and self.api_key is None:
            raise ValueError("metrics_require_key needs an api_key")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
        adapters = [module.name for module in self.lora_modules]
        if len(set(adapters)) < len(adapters):
            raise ValueError(f"lora_modules must have names of their own, got {adapters}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (e.g. 'hermes')")


@dataclass(slots=True)
class ServerState:
    """What the route handlers share, at ``app.state.server``."""

    llm: LLM  # tokenizer and chat template (used on the loop); its engine is the thread's
    config: ServerConfig
    model_name: str  # the served name
    engine: AsyncEngine  # the bridge to the engine thread
    metrics: ServerMetrics
    gate: AdmissionGate  # --max-concurrent and --max-queue
    max_prompt_chars: int  # a longer prompt text cannot fit the context (refused untokenized)
    token_texts: TokenTexts  # each token's text, for logprobs
    responses: ResponseStore | None = None  # --responses-store
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # served adapters, by name
    resolving: asyncio.Lock = field(default_factory=asyncio.Lock)  # one adapter found at a time
    lora_ids: Iterator[int] = field(default_factory=itertools.count)  # for adapters loaded later
    created: int = field(default_factory=lambda: int(time.time()))  # server start, Unix time


def build_app(llm: LLM, config: ServerConfig | None = None) -> FastAPI:
    """An OpenAI-compatible app serving ``llm`` (which it owns from startup to shutdown)."""
    config = config or ServerConfig()
    metrics = ServerMetrics(lambda: llm.engine.verifier.stats)
    state = ServerState(
        llm=llm,
        config=config,
        model_name=config.served_model_name or llm.model_name,
        engine=AsyncEngine(llm.engine, on_iteration=metrics.observe_engine),
        metrics=metrics,
        gate=AdmissionGate(config.max_concurrent, config.max_queue, config.retry_after_s),
        max_prompt_chars=max_prompt_chars(llm.tokenizer, llm.engine.max_model_len),
        token_texts=TokenTexts(llm.tokenizer),
        responses=ResponseStore(config.responses_store) if config.responses_store else None,
    )
    state.loras = serve_adapters(llm, config.lora_modules, state.model_name)
    state.lora_ids = itertools.count(
        max((m.adapter_id for m in config.lora_modules), default=0) + 1
    )
    metrics.queued.set_function(lambda: state.gate.num_waiting)
    metrics.observe_engine(llm.engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.engine.shutdown)

    # No /docs or /redoc: their pages load scripts from a public CDN, which fails offline.
    openapi_url = "/openapi.json" if config.openapi else None
    app = FastAPI(
        title="specdec",
        version="0.1.0",
        lifespan=lifespan,
        openapi_url=openapi_url,
        docs_url=None,
        redoc_url=None,
    )
    app.state.server = state
    app.include_router(router)
    app.include_router(responses_router)
    app.include_router(sagemaker_router)
    app.include_router(embeddings_router)
    app.include_router(scores_router)
    app.include_router(tokenization_router)
    if config.allow_runtime_lora_updating:
        app.include_router(adapters_router)
    install_error_handlers(app)
    # The last added is the outermost: count everything, answer unexpected errors, then check
    # the key, then the size.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key is not None:
        protected = {"/openapi.json", "/tokenize", "/detokenize", "/invocations", "/score"}
        protected |= {"/rerank", "/v2/rerank"}
        protected |= {"/metrics"} if config.metrics_require_key else set()
        app.add_middleware(
            ApiKeyMiddleware,
            api_key=config.api_key,
            is_protected=lambda path: path.startswith("/v1/") or path in protected,
        )
    app.add_middleware(UnexpectedErrors)
    all_routes = (
        *router.routes, *responses_router.routes, *sagemaker_router.routes,
        *embeddings_router.routes, *scores_router.routes, *tokenization_router.routes,
        *adapters_router.routes,
    )  # fmt: skip
    routes = frozenset(getattr(r, "path", "") for r in all_routes)
    app.add_middleware(RequestCountMiddleware, metrics=metrics, routes=routes)
    return app
