"""The Responses API's reply: the response object, its output items, and the stream's events.

A text reply is one ``message`` item holding one ``output_text`` part, streamed as it is
generated. A reply of function calls (``tool_choice`` "required" or a named function) is one
``function_call`` item per call, sent whole once the reply has ended: the text of a
"required" reply is a JSON array that is parsed only when complete. Under
``tool_choice: "auto"`` the parser of the server's ``tool_call_parser`` finds the calls: a
stream sends the text the parser lets through as it comes (the message item opens with its
first text), and the calls, each a ``function_call`` item, whole at the end. Cut short by
``max_output_tokens``, a reply of calls stays text, as chat completions leave it.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from specdec.serving.generation import Generation
from specdec.serving.reasoning import ReasoningSplit, split
from specdec.serving.responses import new_id, now_s
from specdec.serving.responses_store import ResponseStore, output_messages
from specdec.serving.tool_parsers import CallParser, CallStream, ParsedReply
from specdec.serving.tools import tool_calls_of

if TYPE_CHECKING:
    from specdec.serving.responses_api import ResponsesRequest

Status = Literal["in_progress", "completed", "incomplete"]


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


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A reasoning model's thinking, split from its reply under ``--reasoning-parser``."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = []
    content: list[ReasoningText]
    status: Status


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str  # the item's
    call_id: str  # the call's, for its function_call_output
    name: str
    arguments: str  # JSON text
    status: Status


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


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
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: None = None
    store: bool = False  # kept by the server (--responses-store; see responses_store.py)
    temperature: float
    text: dict[str, Any]
    tool_choice: Any
    tools: list[Any]
    top_p: float
    truncation: str = "disabled"
    usage: ResponseUsage | None
    user: None = None
    metadata: dict[str, str]


class Reply:
    """One response under way: its fixed fields, and the body as it stands."""

    def __init__(
        self,
        body: ResponsesRequest,
        model: str,
        generation: Generation,
        auto_tools: CallParser | None = None,  # "auto": the parser of the calls
        store: ResponseStore | None = None,  # where the finished response is kept, if it is
        reasoning: ReasoningSplit | None = None,  # --reasoning-parser's split of the reply
    ):
        self.body, self.model, self.generation = body, model, generation
        self.auto_tools, self.reasoning = auto_tools, reasoning
        self.reasoning_id = new_id("rs")
        self.store = store if body.store is not False else None
        self.id, self.message_id, self.created_at = new_id("resp"), new_id("msg"), now_s()
        # "auto", streamed: the text sent and the calls the stream's parser found
        self.streamed: ParsedReply | None = None

    def response(self, finished: bool) -> ResponseObject:
        """The body: in progress with no output, or finished with its items and usage (and
        then kept in the store, where there is one)."""
        response = self._response(finished)
        if finished and self.store is not None:
            conversation = [*self.body.input, *output_messages(response)]
            self.store.put(response, conversation)
        return response

    def _response(self, finished: bool) -> ResponseObject:
        body, choice = self.body, self.generation.choices[0]
        incomplete = finished and choice.finish_reason == "length"
        status: Status = "incomplete" if incomplete else "completed"
        usage = self.generation.usage()
        format = body.text.format if body.text else None
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status if finished else "in_progress",
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            instructions=body.instructions,
            previous_response_id=body.previous_response_id,
            store=self.store is not None,
            max_output_tokens=body.max_output_tokens,
            model=self.model,
            output=self.output(status) if finished else [],
            parallel_tool_calls=body.parallel_tool_calls is not False,
            temperature=1.0 if body.temperature is None else body.temperature,
            text={
                "format": {"type": "text"}
                if format is None
                else format.model_dump(by_alias=True, exclude_none=True)
            },
            tool_choice=_dumped(body.tool_choice) or "auto",
            tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
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

    def output(self, status: Status) -> list[OutputItem]:
        """The finished reply's items: its thinking (split by ``--reasoning-parser``), then its
        function calls, or one message (none for a reply cut off while thinking)."""
        choice = self.generation.choices[0]
        thinking, answer = None, choice.text  # type: tuple[str | None, str | None]
        if self.reasoning is not None:
            thinking, answer = split(choice.text, self.reasoning.opened)
        items: list[OutputItem] = [self.thought(thinking, status)] if thinking else []
        calls, said = None, None
        if self.body.calls_tools and choice.finish_reason == "stop":
            calls = tool_calls_of(answer or "", self.body.chat_tool_choice())
        elif self.auto_tools is not None and choice.finish_reason == "stop":
            parsed = self.streamed or self.auto_tools.parse(answer or "")
            calls, said = parsed.tool_calls or None, parsed.content
        if calls is None:
            return items + ([self.message(answer, status)] if answer is not None else [])
        text: list[OutputItem] = [self.message(said, status)] if said else []
        return (
            items
            + text
            + [
                FunctionCallItem(
                    id=f"fc_{uuid.uuid4().hex}",
                    call_id=call.id,
                    name=call.function.name,
                    arguments=call.function.arguments,
                    status="completed",
                )
                for call in calls
            ]
        )

    def message(self, text: str, status: Status) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=status, content=[OutputText(text=text)])

    def thought(self, text: str, status: Status) -> ReasoningItem:
        content = [ReasoningText(text=text)] if text else []
        return ReasoningItem(id=self.reasoning_id, content=content, status=status)


def _dumped(value: Any) -> Any:
    return value.model_dump() if isinstance(value, BaseModel) else value


class Event(BaseModel):
    """A stream event: its ``type``, ``sequence_number`` and the type's own fields."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


async def events(reply: Reply) -> AsyncIterator[Event]:
    """OpenAI's stream of semantic events: a text reply's text as it is generated, a reply of
    calls item by item once it has ended."""
    number = 0

    def event(kind: str, **fields: Any) -> Event:
        nonlocal number
        number += 1
        return Event(type=f"response.{kind}", sequence_number=number - 1, **fields)

    started = reply.response(finished=False)
    yield event("created", response=started)
    yield event("in_progress", response=started)
    live = not reply.body.calls_tools  # text goes out as it comes; calls whole at the end
    auto = reply.auto_tools.stream() if reply.auto_tools is not None else None
    splits = reply.reasoning.stream() if reply.reasoning is not None else None
    where = {"item_id": reply.message_id, "output_index": 0, "content_index": 0}
    thinking = {"item_id": reply.reasoning_id, "output_index": 0, "content_index": 0}
    thought_open = False  # the reasoning item, with the reply's first thinking
    message_open = False  # at once for plain text, with its first text under "auto" or a split
    said = ""
    async for _, delta in reply.generation.deltas():
        if splits is not None:  # the thinking goes out as reasoning, the rest on as the text
            thought, answer = splits.feed_delta(delta)
            if thought and not thought_open:
                thought_open, where["output_index"] = True, 1
                opening = reply.thought("", "in_progress")
                yield event("output_item.added", output_index=0, item=opening)
                yield event("content_part.added", **thinking, part=ReasoningText(text=""))
            if thought:
                yield event("reasoning_text.delta", **thinking, delta=thought)
            delta = dataclasses.replace(delta, text=answer)
        text = delta.text if auto is None else _let_through(auto, delta)
        if not live or not (text or (auto is None and splits is None)):
            continue
        if not message_open:
            message_open = True
            message = reply.message("", "in_progress")
            yield event("output_item.added", output_index=where["output_index"], item=message)
            yield event("content_part.added", **where, part=OutputText(text=""))
        if text:
            said += text
            yield event("output_text.delta", **where, delta=text, logprobs=[])
    if auto is not None and auto.calls:
        reply.streamed = ParsedReply(said or None, auto.calls)
    done = reply.response(finished=True)
    for index, item in enumerate(done.output):
        streamed = (message_open and isinstance(item, OutputMessage)) or (
            thought_open and isinstance(item, ReasoningItem)
        )  # its text went out already
        if not streamed:  # the item opens now, and its content comes whole
            opened = item.model_copy(update={"status": "in_progress"})
            if isinstance(item, FunctionCallItem):
                opened = opened.model_copy(update={"arguments": ""})
            else:
                opened = opened.model_copy(update={"content": []})
            yield event("output_item.added", output_index=index, item=opened)
        if isinstance(item, ReasoningItem):
            text = item.content[0].text if item.content else ""
            if not streamed:
                yield event("content_part.added", **thinking, part=ReasoningText(text=""))
                yield event("reasoning_text.delta", **thinking, delta=text)
            yield event("reasoning_text.done", **thinking, text=text)
            yield event("content_part.done", **thinking, part=ReasoningText(text=text))
        elif isinstance(item, FunctionCallItem):
            call = {"item_id": item.id, "output_index": index}
            yield event("function_call_arguments.delta", **call, delta=item.arguments)
            yield event("function_call_arguments.done", **call, arguments=item.arguments)
        else:
            text = item.content[0].text
            if not streamed:
                yield event("content_part.added", **where, part=OutputText(text=""))
                yield event("output_text.delta", **where, delta=text, logprobs=[])
            yield event("output_text.done", **where, text=text, logprobs=[])
            yield event("content_part.done", **where, part=OutputText(text=text))
        yield event("output_item.done", output_index=index, item=item)
    yield event("completed" if done.status == "completed" else "incomplete", response=done)


def _let_through(stream: CallStream, delta: Any) -> str:
    """Under "auto": the text the parser lets through for ``delta``; at the end, what it held
    back (the text before the calls, or all of it where no call parses or the reply was cut
    short). The calls it found are then ``stream.calls``."""
    text = stream.feed(delta.text)
    if not delta.finished:
        return text
    if delta.finish_reason != "stop":
        return text + stream.flush()
    return text + (stream.finish().content or "")
