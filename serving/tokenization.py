"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt's token ids as the generation
routes would feed them (a raw prompt, or messages through the chat template), and the text of
token ids."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from specdec.serving.errors import APIError
from specdec.serving.protocol import ChatMessage, ChatTemplateFields, template_message
from specdec.serving.routes import check_model, render_chat, server_state
from specdec.serving.strict import StrictModel

router = APIRouter()


class TokenizeRequest(ChatTemplateFields):
    """``POST /tokenize`` (vLLM's): a prompt's token ids, as completions (``prompt``) or chat
    completions (``messages``, through the chat template) would feed them."""

    model: str | None = None
    prompt: str | None = None  # a raw text ...
    messages: list[ChatMessage] | None = None  # ... or a conversation: exactly one of the two
    return_token_strs: bool | None = None  # also each token's string in the vocabulary

    def conversation(self) -> list[dict[str, Any]]:
        return [template_message(m) for m in self.messages or []]


class DetokenizeRequest(StrictModel):
    """``POST /detokenize`` (vLLM's): the text of token ids."""

    model: str | None = None
    tokens: list[int]  # token ids of the vocabulary


class TokenizeResponse(BaseModel):
    count: int  # tokens in the prompt
    max_model_len: int  # longest prompt + output, in tokens
    tokens: list[int]  # the token ids
    token_strs: list[str] | None = None  # each token's vocabulary string, when asked for


class DetokenizeResponse(BaseModel):
    prompt: str  # the text of the tokens


@router.post("/tokenize")
async def tokenize_route(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """A prompt's token ids, as the generation routes would feed them (vLLM's endpoint)."""
    state = server_state(request)
    await check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        if not body.messages:
            raise APIError(400, "messages must contain at least one message", param="messages")
        text = await render_chat(state, body.conversation(), body.chat_options())
    else:
        text = body.prompt or ""
    tokens = await asyncio.to_thread(state.llm.encode, text)
    strs = None
    if body.return_token_strs:
        strs = list(await asyncio.to_thread(state.llm.tokenizer.convert_ids_to_tokens, tokens))
    max_model_len = state.llm.engine.max_model_len
    return TokenizeResponse(
        count=len(tokens), max_model_len=max_model_len, tokens=tokens, token_strs=strs
    )


@router.post("/detokenize")
async def detokenize_route(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """The text of token ids (vLLM's endpoint)."""
    state = server_state(request)
    await check_model(state, body.model)
    vocab_size = state.llm.engine.vocab_size
    if any(not 0 <= t < vocab_size for t in body.tokens):
        raise APIError(400, f"tokens must be token ids in [0, {vocab_size})", param="tokens")
    return DetokenizeResponse(prompt=await asyncio.to_thread(state.llm.decode, body.tokens))
