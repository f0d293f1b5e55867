"""OpenAI's Responses API, ``POST /v1/responses``, on the chat completions' machinery.

A request's ``instructions`` (a system message) and ``input`` (a text, or a list of items:
messages, earlier ``function_call`` items and their ``function_call_output``) go through the
chat template; ``max_output_tokens``, ``temperature``, ``top_p`` and ``text.format`` (plain
text, any JSON object, or a JSON Schema: guided decoding) shape the reply, and the sampling
extras of chat completions (``seed``, ``top_k``, ...) are taken too, as vLLM's server takes
them. Function tools are called as chat completions call them (``tools.py``): ``tool_choice``
"required" or a named function, on guided decoding. :mod:`responses_render` builds the reply.

Responses are stored only on a server started with ``--responses-store N``
(:mod:`responses_store`): then ``previous_response_id`` continues a stored conversation and
``GET`` / ``DELETE /v1/responses/{id}`` read and forget one; without it ``store`` is answered
``false`` and ``previous_response_id`` is refused. ``background``, reasoning and ``truncation:
"auto"`` are refused, each with a 400 that names the field. ``tool_choice: "auto"`` needs a
server started with a tool-call parser, as chat completions do.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, ValidationInfo, field_validator

from specdec.llm import ChatOptions
from specdec.serving.adapters import served_name
from specdec.serving.errors import APIError
from specdec.serving.guided import format_guide, guides_given
from specdec.serving.protocol import (
    ChatMessage,
    ChatTemplateFields,
    GenerationFields,
    template_message,
)
from specdec.serving.reasoning import guide_after, reasoning_split
from specdec.serving.responses_render import Reply, ResponseObject, events
from specdec.serving.responses_store import ResponseStore
from specdec.serving.routes import (
    auto_tools,
    check_model,
    check_stops,
    make_generation,
    render_chat,
    respond,
    server_state,
    tokenize,
)
from specdec.serving.strict import StrictModel
from specdec.serving.tools import (
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    Tool,
    ToolChoiceRules,
    calls_schema,
    check_tool_choice,
)

if TYPE_CHECKING:
    from specdec.serving.app import ServerState

router = APIRouter()
INPUT_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


class TextFormat(StrictModel):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type":
    "json_schema", "name": ..., "schema": {...}, "strict": ...}``."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(StrictModel):
    format: TextFormat | None = None  # None: plain text


class FunctionTool(StrictModel):
    """A function tool as the Responses API gives it (flat, where chat nests ``function``)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments; None: none
    strict: bool | None = None  # as chat's (serving/tools.py FunctionDefinition)


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(GenerationFields, ChatTemplateFields, ToolChoiceRules):
    """``POST /v1/responses``: reply to ``instructions`` and ``input``, through the chat
    template. The chat completions' sampling fields are accepted as extras."""

    input: list[ChatMessage]  # a text (one user message) or messages: text content only
    instructions: str | None = None  # a system message put before the input
    max_output_tokens: int | None = Field(None, ge=1)  # most tokens of the reply; None: context
    text: TextOptions | None = None  # the reply's format
    store: bool | None = None  # nothing is stored: answered false whatever it is
    metadata: dict[str, str] | None = None  # given back in the response
    parallel_tool_calls: bool | None = None  # given back; the calls are made as tool_choice says
    # function tools, {"type": "function", "name", "description", "parameters"}, and whether to
    # call them: "none", "required", {"type": "function", "name": ...} or "auto" (on a server
    # with a tool-call parser), as chat completions call them: see tools.py
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = Field(
        None,
        validate_default=True,  # checked when left out too: with tools it means "auto"
    )
    previous_response_id: str | None = None  # continue a stored response's conversation
    background: Any = None
    reasoning: Any = None
    truncation: Any = None
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        **GenerationFields.NEUTRAL,
        "n": (None, 1),  # one reply per response
        "prompt_logprobs": (None,),
        "return_tokens_as_token_ids": (None, False),
        "background": (None, False),
        "reasoning": (None,),
        "truncation": (None, "disabled"),
    }

    @field_validator("input", mode="before")
    @classmethod
    def _messages(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if not isinstance(value, list) or not value:
            raise ValueError("must be a text or a non-empty list of messages")
        return [_message(item) for item in value]

    @field_validator("text")
    @classmethod
    def _one_guide(cls, value: TextOptions | None, info: ValidationInfo) -> TextOptions | None:
        format = _format(value)
        kind = "text" if format is None else format.type
        if format is not None and kind == "json_schema" and format.schema_ is None:
            raise ValueError('format json_schema needs {"name": ..., "schema": {...}}')
        given = guides_given(info.data)
        if kind != "text" and given:
            raise ValueError(f"give one of {given[0]} and text.format, not both")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        names = [t.name for t in info.data.get("tools") or []]
        named = value.name if isinstance(value, NamedFunction) else None
        text = info.data.get("text")
        given = [*guides_given(info.data), *(["text.format"] if _format(text) else [])]
        check_tool_choice(value, names, named, given)
        return value

    def chat_tools(self) -> list[Tool]:
        """The tools as chat completions take them."""
        return [
            Tool(type="function", function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters,
                strict=t.strict))
            for t in self.tools or []
        ]  # fmt: skip

    def chat_tool_choice(self) -> Any:
        """tool_choice as chat completions take it."""
        if isinstance(self.tool_choice, NamedFunction):
            return NamedToolChoice(
                type="function", function=FunctionName(name=self.tool_choice.name)
            )
        return self.tool_choice

    def chat_options(self) -> ChatOptions:
        options = super().chat_options()
        tools = [t.model_dump(exclude_none=True) for t in self.chat_tools()]
        return dataclasses.replace(options, tools=tools or None)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens or super().requested_max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_output_tokens" if self.max_output_tokens else super().max_tokens_param

    def guide(self) -> dict[str, Any]:
        if self.calls_tools:
            return {"json_schema": calls_schema(self.chat_tools(), self.chat_tool_choice())}
        format = _format(self.text)
        if format is None or format.type == "text":
            return super().guide()
        return format_guide(format.type, format.schema_)

    def guide_field(self) -> str:
        if self.calls_tools:
            return "tools"
        format = _format(self.text)
        return "text" if format and format.type != "text" else super().guide_field()

    def longer_part(self) -> str:
        """The field that holds most of the prompt's text, to name when it is too long."""
        input_chars = sum(len(m.content or "") for m in self.input)
        return "instructions" if len(self.instructions or "") > input_chars else "input"

    def conversation(self) -> list[dict[str, Any]]:
        system = (
            []
            if self.instructions is None
            else [ChatMessage(role="system", content=self.instructions)]
        )
        return [template_message(m) for m in [*system, *self.input]]


def _format(text: TextOptions | None) -> TextFormat | None:
    return None if text is None else text.format


def _message(item: Any) -> Any:
    """An input item as a chat message: a message (``type`` "message" or none) with a text or
    text parts (input_text, output_text); an earlier ``function_call`` as an assistant's call;
    a ``function_call_output`` as the tool's answer."""
    kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
    fields = {"function_call": ("call_id", "name", "arguments"),
              "function_call_output": ("call_id", "output")}.get(kind, ())  # fmt: skip
    if not all(isinstance(item.get(f), str) for f in fields):
        raise ValueError(f"a {kind} item needs {', '.join(fields)}, each a string")
    if kind == "function_call":
        function = {"name": item.get("name"), "arguments": item.get("arguments")}
        call = {"id": item.get("call_id"), "type": "function", "function": function}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")}
    if kind != "message":
        raise ValueError(
            f"only message, function_call and function_call_output items are supported, got {kind!r}"
        )
    if item.get("role") not in INPUT_ROLES:
        raise ValueError(f"a message's role must be one of {', '.join(INPUT_ROLES)}")
    content = item.get("content")
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text content parts are supported, got {kind!r}")
        content = [{"type": "text", "text": part.get("text")} for part in content]
    return {"role": item["role"], "content": content}


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    state = server_state(request)
    await check_model(state, body.model)
    check_stops(state, body)
    if body.use_beam_search:
        message = "use_beam_search is not supported by the Responses API: use chat completions"
        raise APIError(400, message, param="use_beam_search")
    if body.previous_response_id is not None:  # its conversation, then this input
        earlier = stored_responses(state, "previous_response_id").get(
            body.previous_response_id, "previous_response_id"
        )
        body.input = [*earlier.conversation, *body.input]
    names = auto_tools(state, body)
    text = await render_chat(state, body.conversation(), body.chat_options(), "input")
    prompt = await tokenize(state, text, body.longer_part())
    reasoning = reasoning_split(state.config.reasoning_parser, body, text)
    generation = make_generation(state, body, [prompt], "input", guide_after(reasoning, body))
    reply = Reply(
        body, served_name(state, body.model), generation, names, state.responses, reasoning
    )
    return await respond(
        request,
        generation,
        bool(body.stream),
        lambda: reply.response(finished=True),
        lambda: events(reply),
    )


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> ResponseObject:
    """A stored response, as it was given back."""
    return stored_responses(server_state(request)).get(response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    """Forget a stored response (a conversation that continues it can no longer name it)."""
    stored_responses(server_state(request)).delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def stored_responses(state: ServerState, param: str | None = None) -> ResponseStore:
    """The server's store; 400 where it keeps none."""
    if state.responses is None:
        raise APIError(
            400,
            "this server stores no responses: start it with --responses-store N to keep the "
            "last N, for previous_response_id and /v1/responses/{id}",
            param=param,
        )
    return state.responses
