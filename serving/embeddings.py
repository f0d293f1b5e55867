"""``POST /v1/embeddings``: OpenAI's embeddings API (and vLLM's extra fields) on the served model.

Each input is tokenized as completions' prompts are (or, in vLLM's chat form, ``messages`` go
through the chat template, as chat completions', and give one vector) and runs on the engine as
an embedding request (:mod:`specdec.pooling`): admitted by the same gate, in waves of at most
``max_running`` sequences when a request has more inputs than that, batched beside generation,
aborted when the client leaves. The vectors are the final norm's states pooled by the server's
``--pooling-type`` (the last token's by default) and, unless the request sets ``normalize`` to
false, scaled to unit length. ``encoding_format: "base64"`` sends each vector as the base64 of
its little-endian float32 bytes, as OpenAI's client expects.
"""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, field_validator

from specdec.llm import ChatOptions
from specdec.lora import LoRARequest
from specdec.pooling import PoolingParams
from specdec.serving.adapters import adapter_of, served_name
from specdec.serving.bridge import GenerationRequest
from specdec.serving.errors import APIError
from specdec.serving.generation import Generation, until_disconnected
from specdec.serving.protocol import (
    ChatMessage,
    ChatTemplateFields,
    is_token_ids,
    template_message,
)
from specdec.serving.responses import new_id, now_s
from specdec.serving.routes import (
    CLIENT_CLOSED_REQUEST,
    check_model,
    check_priority_allowed,
    render_chat,
    server_state,
    tokenize,
)
from specdec.serving.strict import TruncatePromptTokens

if TYPE_CHECKING:
    from specdec.serving.app import ServerState

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
    await check_model(state, body.model)
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
    pooling = PoolingParams(normalize=body.normalize)  # the prompts are truncated here
    prompts = [await tokenize(state, text, param, truncate) for text in inputs]
    lora = adapter_of(state, body.model)
    vectors = await embed_prompts(request, state, prompts, pooling, body.priority, param, lora)
    if vectors is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    name = served_name(state, body.model)
    response = _response(vectors, prompts, name, body.encoding_format == "base64")
    return Response(response.model_dump_json(), media_type="application/json")


async def embed_prompts(
    request: Request,
    state: ServerState,
    prompts: list[list[int]],
    pooling: PoolingParams,
    priority: int,
    param: str,
    lora: LoRARequest | None = None,
) -> list[torch.Tensor] | None:
    """Each prompt's vector, run as embedding requests in waves of at most the server's
    ``max_running`` sequences (each wave admitted as one request is, so a request of many
    inputs holds no more room than a full batch); None once the client has left, with what
    was running aborted."""
    vectors: list[torch.Tensor] = []
    wave = state.gate.max_running
    for start in range(0, len(prompts), wave):
        part = prompts[start : start + wave]
        requests = [GenerationRequest(ids, pooling, priority=priority, lora=lora) for ids in part]
        generation = Generation(state, requests, sum(len(p) for p in part), param, True)
        if await until_disconnected(request, generation.start()) is None:
            return None
        try:
            finished = await until_disconnected(request, generation.run())
        finally:
            generation.close()
        if finished is None:
            return None
        vectors.extend(c.embedding for c in generation.choices if c.embedding is not None)
    assert len(vectors) == len(prompts), "an embedding request finished without its vector"
    return vectors


def _response(
    vectors: list[torch.Tensor], prompts: list[list[int]], model: str, as_base64: bool
) -> EmbeddingResponse:
    data = []
    for i, tensor in enumerate(vectors):
        vector = tensor.numpy()
        encoded: list[float] | str = (
            base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            if as_base64
            else vector.astype(np.float64).tolist()
        )
        data.append(EmbeddingData(index=i, embedding=encoded))
    tokens = sum(len(p) for p in prompts)
    return EmbeddingResponse(
        id=new_id("embd"),
        created=now_s(),
        model=model,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
