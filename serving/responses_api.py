"""OpenAI's Responses API, ``POST /v1/responses``, on the chat completions' machinery.

A request's ``instructions`` (a system message) and ``input`` (a text, or a list of messages)
go through the chat template; ``max_output_tokens``, ``temperature``, ``top_p`` and
``text.format`` (plain text, any JSON object, or a JSON Schema: guided decoding) shape the
reply, and the sampling extras of chat completions (``seed``, ``top_k``, ...) are taken too, as
vLLM's server takes them. The reply is one ``message`` output item holding one ``output_text``
part, complete or, when it reached ``max_output_tokens`` or the context, ``incomplete``.

Nothing is stored: ``store`` is answered ``false``, and what needs a stored response
(``previous_response_id``, ``background``) is refused, as are tools, reasoning and ``truncation:
"auto"``, each with a 400 that names the field. A stream sends OpenAI's semantic events, from
``response.created`` to ``response.completed`` (or ``response.incomplete``), each with its
``sequence_number``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from specdec.serving.generation import Generation
from specdec.serving.guided import guides_given
from specdec.serving.protocol import ChatMessage, ChatTemplateFields, GenerationFields
from specdec.serving.responses import new_id, now_s
from specdec.serving.routes import (
    check_model,
    check_stops,
    make_generation,
    render_chat,
    respond,
    server_state,
    tokenize,
)

router = APIRouter()
INPUT_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
Status = Literal["in_progress", "completed", "incomplete"]


class TextFormat(BaseModel):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type":
    "json_schema", "name": ..., "schema": {...}, "strict": ...}``."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    format: TextFormat | None = None  # None: plain text


class ResponsesRequest(GenerationFields, ChatTemplateFields):
    """``POST /v1/responses``: reply to ``instructions`` and ``input``, through the chat
    template. The chat completions' sampling fields are accepted as extras."""

    input: list[ChatMessage]  # a text (one user message) or messages: text content only
    instructions: str | None = None  # a system message put before the input
    max_output_tokens: int | None = Field(None, ge=1)  # most tokens of the reply; None: context
    text: TextOptions | None = None  # the reply's format
    store: bool | None = None  # nothing is stored: answered false whatever it is
    metadata: dict[str, str] | None = None  # given back in the response
    parallel_tool_calls: bool | None = None  # given back; there are no tools to call
    previous_response_id: Any = None
    background: Any = None
    tools: Any = None
    tool_choice: Any = None
    reasoning: Any = None
    truncation: Any = None
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        **GenerationFields.NEUTRAL,
        "n": (None, 1),  # one reply per response
        "prompt_logprobs": (None,),
        "previous_response_id": (None,),  # would need stored responses
        "background": (None, False),
        "tools": (None, []),
        "tool_choice": (None, "none", "auto"),
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
        given = guides_given(info)
        if kind != "text" and given:
            raise ValueError(f"give one of {given[0]} and text.format, not both")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens or super().requested_max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_output_tokens" if self.max_output_tokens else super().max_tokens_param

    @property
    def format_type(self) -> str:
        """The reply's format: "text", "json_object" or "json_schema"."""
        format = _format(self.text)
        return "text" if format is None else format.type

    def guide(self) -> dict[str, Any]:
        format = _format(self.text)
        if format is not None and format.type == "json_object":
            return {"json_schema": {"type": "object"}}
        if format is not None and format.type == "json_schema":
            return {"json_schema": format.schema_}
        return super().guide()

    def guide_field(self) -> str:
        return "text" if self.format_type != "text" else super().guide_field()

    def longer_part(self) -> str:
        """The field that holds most of the prompt's text, to name when it is too long."""
        input_chars = sum(len(m.content or "") for m in self.input)
        return "instructions" if len(self.instructions or "") > input_chars else "input"

    def conversation(self) -> list[dict[str, Any]]:
        system = [] if self.instructions is None else [("system", self.instructions)]
        turns = [*system, *((m.role, m.content or "") for m in self.input)]
        return [{"role": role, "content": content} for role, content in turns]


def _format(text: TextOptions | None) -> TextFormat | None:
    return None if text is None else text.format


def _message(item: Any) -> Any:
    """An input item as a chat message: ``{"role", "content"}`` with ``type`` "message" or
    none, its content a text or a list of text parts (input_text, output_text)."""
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise ValueError(f"only message items are supported, got {kind!r}")
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


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Status
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = {"cached_tokens": 0}
    output_tokens: int
    output_tokens_details: dict[str, int] = {"reasoning_tokens": 0}
    total_tokens: int


class ResponseObject(BaseModel):
    """A response as OpenAI gives it: the request's settings, the output, the usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    error: None = None
    incomplete_details: dict[str, str] | None = None  # {"reason": "max_output_tokens"}
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: None = None
    store: bool = False
    temperature: float
    text: dict[str, Any]
    tool_choice: str
    tools: list[Any] = []
    top_p: float
    truncation: str = "disabled"
    usage: ResponseUsage | None
    user: None = None
    metadata: dict[str, str]


class Reply:
    """One response under way: its fixed fields, and the body as it stands."""

    def __init__(self, body: ResponsesRequest, model: str, generation: Generation):
        self.body, self.model, self.generation = body, model, generation
        self.id, self.message_id, self.created_at = new_id("resp"), new_id("msg"), now_s()

    def response(self, finished: bool) -> ResponseObject:
        """The body: in progress with no output, or finished with the message and usage."""
        body, choice = self.body, self.generation.choices[0]
        incomplete = finished and choice.finish_reason == "length"
        status: Status = (
            "in_progress" if not finished else "incomplete" if incomplete else "completed"
        )
        output = [self.message(choice.text, status)] if finished else []
        usage = self.generation.usage()
        format = _format(body.text)
        text = (
            {"type": "text"}
            if format is None
            else format.model_dump(by_alias=True, exclude_none=True)
        )
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.model,
            output=output,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            temperature=1.0 if body.temperature is None else body.temperature,
            text={"format": text},
            tool_choice=body.tool_choice or "auto",
            top_p=1.0 if body.top_p is None else body.top_p,
            usage=ResponseUsage(
                input_tokens=usage.prompt_tokens,
                output_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens,
            )
            if finished
            else None,
            metadata=body.metadata or {},
        )

    def message(self, text: str, status: Status) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=status, content=[OutputText(text=text)])


class Event(BaseModel):
    """A stream event: its ``type``, ``sequence_number`` and the type's own fields."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


async def events(reply: Reply) -> AsyncIterator[Event]:
    """OpenAI's stream of semantic events for a one-message reply."""
    number = 0

    def event(kind: str, **fields: Any) -> Event:
        nonlocal number
        number += 1
        return Event(type=f"response.{kind}", sequence_number=number - 1, **fields)

    where = {"item_id": reply.message_id, "output_index": 0, "content_index": 0}
    started = reply.response(finished=False)
    yield event("created", response=started)
    yield event("in_progress", response=started)
    yield event("output_item.added", output_index=0, item=reply.message("", "in_progress"))
    yield event("content_part.added", **where, part=OutputText(text=""))
    async for _, delta in reply.generation.deltas():
        if delta.text:
            yield event("output_text.delta", **where, delta=delta.text, logprobs=[])
    done = reply.response(finished=True)
    text = reply.generation.choices[0].text
    yield event("output_text.done", **where, text=text, logprobs=[])
    yield event("content_part.done", **where, part=OutputText(text=text))
    yield event("output_item.done", output_index=0, item=done.output[0])
    yield event("completed" if done.status == "completed" else "incomplete", response=done)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    state = server_state(request)
    check_model(state, body.model)
    check_stops(state, body)
    text = await render_chat(state, body.conversation(), body.chat_options(), "input")
    prompt = await tokenize(state, text, body.longer_part())
    generation = make_generation(state, body, [prompt], "input")
    reply = Reply(body, state.model_name, generation)
    return await respond(
        request,
        generation,
        bool(body.stream),
        lambda: reply.response(finished=True),
        lambda: events(reply),
    )
