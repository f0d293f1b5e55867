"""``POST /v1/embeddings``: OpenAI's embeddings API (and vLLM's extra fields) on the served model.

Each input is tokenized as completions' prompts are (or, in vLLM's chat form, ``messages`` go
through the chat template, as chat completions', and give one vector) and runs on the engine as an embedding
request (:mod:`specdec.pooling`): admitted by the same gate, batched beside generation, aborted
when the client leaves. The vectors are the final norm's states pooled by the server's
``--pooling-type`` (the last token's by default) and, unless the request sets ``normalize`` to
false, scaled to unit length. ``encoding_format: "base64"`` sends each vector as the base64 of
its little-endian float32 bytes, as OpenAI's client expects.
"""

from __future__ import annotations

import base64
from dataclasses import replace
from functools import partial
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, field_validator

from specdec.llm import ChatOptions
from specdec.pooling import PoolingParams
from specdec.serving.bridge import GenerationRequest
from specdec.serving.errors import APIError
from specdec.serving.generation import Generation
from specdec.serving.protocol import (
    ChatMessage,
    ChatTemplateFields,
    is_token_ids,
    template_message,
)
from specdec.serving.responses import new_id, now_s
from specdec.serving.routes import (
    check_model,
    check_priority_allowed,
    render_chat,
    respond,
    server_state,
    tokenize,
)
from specdec.serving.strict import TruncatePromptTokens

router = APIRouter()


class EmbeddingRequest(ChatTemplateFields):
    """``POST /v1/embeddings``: one vector per input, or one for a conversation (vLLM's chat
    form: ``messages`` through the chat template, the assistant's turn not opened unless
    ``add_generation_prompt`` is true)."""

    model: str | None = None
    input: list[str | list[int]] | None = None  # a string, a list of strings, token ids or lists
    messages: list[ChatMessage] | None = None  # extra (vLLM's): a conversation instead of input
    encoding_format: Literal["float", "base64"] | None = None  # None: "float"
    dimensions: int | None = None  # Matryoshka truncation: refused (no model here has it)
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    # extra (vLLM's): keep each input's last k tokens (-1: as many as fit the context)
    truncate_prompt_tokens: TruncatePromptTokens = None
    normalize: bool | None = None  # extra (vLLM's): None or true scales to unit length
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # extra (vLLM's): lower first

    @field_validator("input", mode="before")
    @classmethod
    def _input_as_list(cls, value: Any) -> Any:  # noqa: ANN401
        if value is None:
            return None
        if isinstance(value, str) or (is_token_ids(value) and value):
            value = [value]
        if isinstance(value, list) and value and all(_one_input(p) for p in value):
            return value
        raise ValueError(
            "must be a non-empty string, a list of them, a list of token ids or a list of "
            "token-id lists (none empty)"
        )

    def chat_options(self) -> ChatOptions:
        """As chat's, but the assistant's turn stays closed unless asked for (vLLM's default
        for embeddings: the vector is the conversation's, not a reply's start)."""
        return replace(
            super().chat_options(), add_generation_prompt=bool(self.add_generation_prompt)
        )

    def conversation(self) -> list[dict[str, Any]]:
        return [template_message(m) for m in self.messages or []]


def _one_input(value: Any) -> bool:  # noqa: ANN401
    """Whether ``value`` is one input: a non-empty text or a non-empty list of token ids."""
    return (isinstance(value, str) or is_token_ids(value)) and len(value) > 0


class EmbeddingData(BaseModel):
    index: int  # the input's position in the request
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # the vector, or its float32 bytes in base64


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    state = server_state(request)
    check_model(state, body.model)
    if body.dimensions is not None:
        raise APIError(
            400,
            f"dimensions={body.dimensions}: this model was not trained for Matryoshka "
            "embeddings, so its vectors cannot be shortened; leave dimensions unset",
            param="dimensions",
        )
    check_priority_allowed(state, body.priority)
    if (body.input is None) == (body.messages is None):
        raise APIError(400, "give exactly one of input or messages", param="input")
    truncate, param = body.truncate_prompt_tokens, "input"
    inputs: list[str | list[int]]
    if body.messages is not None:
        if not body.messages:
            raise APIError(400, "messages must contain at least one message", param="messages")
        text = await render_chat(state, body.conversation(), body.chat_options())
        param, inputs = "messages", [text]
    else:
        inputs = body.input or []
    if len(inputs) > state.gate.max_running:
        raise APIError(
            400,
            f"this request has {len(inputs)} inputs, but the server runs at most "
            f"{state.gate.max_running} sequences at once: send fewer inputs per request",
            param="input",
        )
    pooling = PoolingParams(normalize=body.normalize)  # the prompts are truncated here
    prompts = [await tokenize(state, text, param, truncate) for text in inputs]
    requests = [GenerationRequest(ids, pooling, priority=body.priority) for ids in prompts]
    generation = Generation(state, requests, sum(len(p) for p in prompts), param, True)
    full = partial(_response, generation, state.model_name, body.encoding_format == "base64")
    return await respond(request, generation, False, full, _no_chunks)


def _response(generation: Generation, model: str, as_base64: bool) -> EmbeddingResponse:
    data = []
    for i, choice in enumerate(generation.choices):
        assert choice.embedding is not None
        vector = choice.embedding.numpy()
        encoded: list[float] | str = (
            base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            if as_base64
            else vector.astype(np.float64).tolist()
        )
        data.append(EmbeddingData(index=i, embedding=encoded))
    tokens = generation.num_prompt_tokens
    return EmbeddingResponse(
        id=new_id("embd"),
        created=now_s(),
        model=model,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


async def _no_chunks() -> Any:  # noqa: ANN401 - embeddings are never streamed
    raise AssertionError("embeddings are not streamed")
    yield  # pragma: no cover
