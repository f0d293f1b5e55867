"""Response bodies of the OpenAI-compatible API (the shapes the ``openai`` client parses).

A streamed response is a sequence of chunks, each sent as a server-sent event ``data: {json}``,
ended by ``data: [DONE]``. With ``stream_options.include_usage`` every chunk carries
``"usage": null`` and one last chunk carries the usage and no choices.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int  # prompt tokens, counted once per prompt whatever n is
    completion_tokens: int  # tokens generated, over all choices
    total_tokens: int  # the sum of both


class CompletionLogprobs(BaseModel):
    """The legacy completions' logprobs: one entry per token in every list (with echo, the
    prompt's tokens first; the first prompt token's logprob and alternatives are null)."""

    tokens: list[str]  # each token's text
    token_logprobs: list[float | None]  # its log-probability
    # the `logprobs` most likely tokens' texts and log-probabilities, and the token's own
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # where each token's text starts, in characters from the choice's


class PromptLogprob(BaseModel):
    """One token of a prompt position's ``prompt_logprobs`` entry (vLLM's shape)."""

    logprob: float
    rank: int  # 1 + how many tokens the model found strictly more likely
    decoded_token: str  # the token's text


# vLLM's prompt_logprobs: per prompt token, None for the first, else token id (a string in JSON)
# -> its entry, for the prompt's token and the most likely ones at that position
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int  # position in choices: prompt index x n + choice number
    text: str  # the generated text, after the prompt with echo (a delta when streamed)
    logprobs: CompletionLogprobs | None = None  # when the request set logprobs
    prompt_logprobs: PromptLogprobs | None = None  # when the request set prompt_logprobs
    finish_reason: str | None = None  # "stop" or "length"; None while streaming


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed one (same object type, as OpenAI sends)."""

    id: str  # "cmpl-..."; the same for every chunk of a stream
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)  # Unix time of the request
    model: str  # the served model's name
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always in a full response; in the last chunk if asked for


class TopLogprob(BaseModel):
    token: str  # the token's text
    logprob: float  # its log-probability
    bytes: list[int]  # its text's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the `top_logprobs` most likely tokens, most likely first


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]  # one per generated token
    refusal: None = None


class Reasoning(BaseModel):
    """A reasoning model's thinking, split from its answer under ``--reasoning-parser``: sent
    under vLLM's name and again under DeepSeek's (``reasoning_content``), both left out where
    there is none."""

    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _with_both_names(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("reasoning") is None:
            data.pop("reasoning", None)
        else:
            data["reasoning_content"] = data["reasoning"]
        return data  # type: ignore[no-any-return]


class AssistantMessage(Reasoning):
    role: Literal["assistant"] = "assistant"
    content: str | None  # the reply (None: a reasoning model cut off while thinking)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text of the arguments


class ToolCall(BaseModel):
    id: str  # "call_<hex>"
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallsMessage(Reasoning):
    """A reply that calls functions: under ``tool_choice`` "required" or a named function, or
    under "auto" where the model chose to (then with any text it wrote before its calls)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall]


class ChatChoice(BaseModel):
    index: int  # position in choices
    message: AssistantMessage | ToolCallsMessage  # the reply
    logprobs: ChatLogprobs | None = None  # when the request set logprobs
    finish_reason: str | None  # "stop" or "length"


class ChatCompletionResponse(BaseModel):
    id: str  # "chatcmpl-..."
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)  # Unix time of the request
    model: str  # the served model's name
    choices: list[ChatChoice]
    usage: Usage  # token counts of the request
    prompt_logprobs: PromptLogprobs | None = None  # when the request set prompt_logprobs


class ChatDelta(Reasoning):
    role: Literal["assistant"] | None = None  # only in a choice's first chunk
    content: str | None = None  # new text


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in a call's first chunk
    arguments: str  # new text of the arguments


class DeltaToolCall(BaseModel):
    index: int  # which call of the reply this chunk extends
    id: str | None = None  # in a call's first chunk
    type: Literal["function"] | None = None  # in a call's first chunk
    function: DeltaFunctionCall


class ToolCallsDelta(BaseModel):
    role: Literal["assistant"] | None = None
    tool_calls: list[DeltaToolCall]


class ChatChunkChoice(BaseModel):
    index: int  # which choice this chunk extends
    delta: ChatDelta | ToolCallsDelta  # what is new
    logprobs: ChatLogprobs | None = None  # the new tokens', when the request set logprobs
    finish_reason: str | None = None  # set in the choice's last chunk


class ChatCompletionChunk(BaseModel):
    id: str  # the same for every chunk of a stream
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)  # Unix time of the request
    model: str  # the served model's name
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only in the last chunk, and only if asked for


class ModelCard(BaseModel):
    id: str  # the name requests give as `model`
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)  # when the server started
    owned_by: str = "specdec"
    max_model_len: int  # longest prompt + output, in tokens
    root: str | None = None  # the model's source (vLLM's field): an adapter's path
    parent: str | None = None  # a LoRA adapter's base model; None for the base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]  # the model served, then its LoRA adapters
