"""Turning a :class:`Generation` into OpenAI response bodies and stream chunks.

A full response is built once every choice has finished. A stream sends a chunk per delta that
carries text or a finish reason (deltas whose text is held back, e.g. a possible stop string, send
nothing); chat streams first open each choice with its role, as OpenAI does. A completion with
``echo`` starts each choice's text, and its logprobs, with the prompt's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.outputs import TokenLogprobs
from specdec.serving.generation import Choice, Generation
from specdec.serving.logprobs import (
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
    text_length,
    token_id_text,
)
from specdec.serving.reasoning import ReasoningSplit, split
from specdec.serving.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaToolCall,
    PromptLogprobs,
    ToolCallsDelta,
    ToolCallsMessage,
    new_id,
    now_s,
)
from specdec.serving.tool_parsers import CallParser, CallStream
from specdec.serving.tools import new_call_id, tool_calls_of


@dataclass(slots=True)
class ResponseMeta:
    """What every body and chunk of one response repeats."""

    prefix: str  # "cmpl" or "chatcmpl"
    model: str  # the served model's name
    id: str = ""  # "<prefix>-<hex>", drawn at construction
    created: int = field(default_factory=now_s)  # Unix time of the request
    echo: list[str] | None = None  # each choice's start: its prompt (chat: the final message)
    prompt_logprobs: bool = False  # show the prompt tokens' logprobs (vLLM's prompt_logprobs)
    tool_choice: Any = None  # "required" or a named function: the replies are function calls
    auto_tools: CallParser | None = None  # "auto": the parser of the calls, for the tools
    token_ids: bool = False  # logprobs name tokens "token_id:<id>" (return_tokens_as_token_ids)
    continuous_usage: bool = False  # every chunk holds the usage so far (continuous_usage_stats)
    reasoning: ReasoningSplit | None = None  # --reasoning-parser's split of the replies

    def __post_init__(self) -> None:
        self.id = self.id or new_id(self.prefix)

    def token_texts(self, generation: Generation) -> Callable[[int], str]:
        """How the logprobs name a token: its text, or its id."""
        return token_id_text if self.token_ids else generation.state.token_texts


def completion_response(generation: Generation, meta: ResponseMeta) -> CompletionResponse:
    texts, echo = meta.token_texts(generation), meta.echo
    choices = []
    for i, c in enumerate(generation.choices):
        logprobs = None
        if c.logprobs is not None:
            token_ids, lps = _echoed(c, echo is not None)
            token_ids += [lp.token_id for lp in c.logprobs]
            logprobs = completion_logprobs(token_ids, [*lps, *c.logprobs], texts)
        text = c.text if echo is None else echo[i] + c.text
        choices.append(
            CompletionChoice(
                index=i,
                text=text,
                logprobs=logprobs,
                prompt_logprobs=_prompt_logprobs(c, meta, texts),
                finish_reason=c.finish_reason,
            )
        )
    return CompletionResponse(
        id=meta.id,
        created=meta.created,
        model=meta.model,
        choices=choices,
        usage=generation.usage(),
    )


async def completion_chunks(
    generation: Generation, meta: ResponseMeta, include_usage: bool
) -> AsyncIterator[CompletionResponse]:
    """The stream; with echo a choice's first chunk starts with its prompt (and the prompt
    tokens' logprobs, which come with its first delta)."""

    def chunk(choices: list[CompletionChoice]) -> CompletionResponse:
        return CompletionResponse(
            id=meta.id, created=meta.created, model=meta.model, choices=choices,
            usage=generation.usage() if meta.continuous_usage else None,
        )  # fmt: skip

    texts, echo = meta.token_texts(generation), meta.echo
    offsets = [0] * len(generation.choices)  # each choice's text_offset so far
    echoed = [echo is None] * len(generation.choices)  # the prompt sent (or not to be sent)
    async for i, delta in generation.deltas():
        prompt_text = ""
        token_ids: list[int] = []
        lps: list[TokenLogprobs | None] = []
        if not echoed[i] and echo is not None:
            echoed[i] = True
            prompt_text = echo[i]
            token_ids, lps = _echoed(generation.choices[i], True)
        if prompt_text or delta.text or delta.finished or delta.logprobs:
            reason = delta.finish_reason if delta.finished else None
            logprobs = None
            if delta.logprobs is not None:
                token_ids += [lp.token_id for lp in delta.logprobs]
                logprobs = completion_logprobs(
                    token_ids, [*lps, *delta.logprobs], texts, offsets[i]
                )
                offsets[i] += text_length(token_ids, texts)
            text = prompt_text + delta.text
            yield chunk(
                [CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=reason)]
            )
    if include_usage:
        yield chunk([]).model_copy(update={"usage": generation.usage()})


def _prompt_logprobs(
    choice: Choice, meta: ResponseMeta, texts: Callable[[int], str]
) -> PromptLogprobs | None:
    if not meta.prompt_logprobs or choice.prompt_logprobs is None:
        return None
    return prompt_logprobs(choice.prompt_logprobs, texts)


def _echoed(choice: Choice, echo: bool) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The prompt's token ids and logprobs that start an echoed choice's logprobs."""
    if not echo or choice.prompt_logprobs is None:
        return [], []
    return list(choice.prompt_token_ids), list(choice.prompt_logprobs)


def chat_response(generation: Generation, meta: ResponseMeta) -> ChatCompletionResponse:
    texts = meta.token_texts(generation)
    choices = []
    for i, c in enumerate(generation.choices):
        reasoning, text = _split(c.text, meta)
        message: AssistantMessage | ToolCallsMessage
        content = text if meta.echo is None else meta.echo[i] + (text or "")
        message = AssistantMessage(content=content, reasoning=reasoning)
        reason = c.finish_reason
        calls = _calls(text or "", reason, meta)
        if calls is not None:
            message = ToolCallsMessage(tool_calls=calls, reasoning=reasoning)
            reason = _calls_reason(meta)
        elif meta.auto_tools is not None and reason == "stop":
            parsed = meta.auto_tools.parse(text or "")
            if parsed.tool_calls:
                message = ToolCallsMessage(
                    content=parsed.content, tool_calls=parsed.tool_calls, reasoning=reasoning
                )
                reason = "tool_calls"
        logprobs = None if c.logprobs is None else chat_logprobs(c.logprobs, texts)
        choices.append(
            ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=reason)
        )
    return ChatCompletionResponse(
        id=meta.id,
        created=meta.created,
        model=meta.model,
        choices=choices,
        usage=generation.usage(),
        prompt_logprobs=_prompt_logprobs(generation.choices[0], meta, texts),  # one prompt
    )


async def chat_chunks(
    generation: Generation, meta: ResponseMeta, include_usage: bool
) -> AsyncIterator[ChatCompletionChunk]:
    def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=meta.id, created=meta.created, model=meta.model, choices=choices,
            usage=generation.usage() if meta.continuous_usage else None,
        )  # fmt: skip

    named = meta.tool_choice is not None and not isinstance(meta.tool_choice, str)
    for i in range(len(generation.choices)):
        opening: ChatDelta | ToolCallsDelta
        opening = ChatDelta(role="assistant", content="" if meta.echo is None else meta.echo[i])
        if named:  # the one call opens at once; its arguments arrive as text does
            call = DeltaToolCall(
                index=0,
                id=new_call_id(),
                type="function",
                function=DeltaFunctionCall(name=meta.tool_choice.function.name, arguments=""),
            )
            opening = ToolCallsDelta(role="assistant", tool_calls=[call])
        yield chunk([ChatChunkChoice(index=i, delta=opening)])
    texts = meta.token_texts(generation)
    held = [""] * len(generation.choices)  # "required": each reply's text, parsed at its end
    auto = [meta.auto_tools.stream() for _ in held] if meta.auto_tools is not None else None
    splits = [meta.reasoning.stream() for _ in held] if meta.reasoning is not None else None
    async for i, delta in generation.deltas():
        if splits is not None:  # the thinking goes out as reasoning, the rest on as the text
            thinking, text = splits[i].feed_delta(delta)
            if thinking and meta.reasoning is not None and meta.reasoning.include:
                thought = ChatDelta(reasoning=thinking)
                yield chunk([ChatChunkChoice(index=i, delta=thought)])
            delta = dataclasses.replace(delta, text=text)
        if auto is not None:
            for chunk_choice in _auto_deltas(auto[i], i, delta, texts):
                yield chunk([chunk_choice])
            continue
        if delta.text or delta.finished or delta.logprobs:
            reason = delta.finish_reason if delta.finished else None
            content: ChatDelta | ToolCallsDelta = ChatDelta(content=delta.text)
            if named:
                arguments = DeltaFunctionCall(arguments=delta.text)
                content = ToolCallsDelta(tool_calls=[DeltaToolCall(index=0, function=arguments)])
                reason = _calls_reason(meta) if reason == "stop" else reason
            elif meta.tool_choice is not None:
                held[i] += delta.text
                content = ChatDelta(content="")
                calls = _calls(held[i], reason, meta) if delta.finished else None
                if calls is not None:
                    content = ToolCallsDelta(tool_calls=[_whole(k, c) for k, c in enumerate(calls)])
                    reason = _calls_reason(meta)
                elif delta.finished:
                    content = ChatDelta(content=held[i])  # cut short: the text as it is
            logprobs = None if delta.logprobs is None else chat_logprobs(delta.logprobs, texts)
            yield chunk(
                [ChatChunkChoice(index=i, delta=content, logprobs=logprobs, finish_reason=reason)]
            )
    if include_usage:
        yield chunk([]).model_copy(update={"usage": generation.usage()})


def _auto_deltas(
    stream: CallStream, i: int, delta: Any, texts: Callable[[int], str]
) -> list[ChatChunkChoice]:
    """Under "auto": the text the parser lets through now; at the end, what it held back, then
    the calls whole (finish_reason "tool_calls"), or the held text if it holds no call."""
    content = stream.feed(delta.text)
    logprobs = None if delta.logprobs is None else chat_logprobs(delta.logprobs, texts)
    if not delta.finished:
        if not content and not logprobs:
            return []
        return [ChatChunkChoice(index=i, delta=ChatDelta(content=content), logprobs=logprobs)]
    if delta.finish_reason == "stop":
        parsed = stream.finish()
        calls, rest = parsed.tool_calls, content + (parsed.content or "")
    else:  # cut short: what was held back stays text
        calls, rest = [], content + stream.flush()
    if not calls:
        text = ChatDelta(content=rest)
        return [
            ChatChunkChoice(
                index=i, delta=text, logprobs=logprobs, finish_reason=delta.finish_reason
            )
        ]
    whole = ToolCallsDelta(tool_calls=[_whole(k, c) for k, c in enumerate(calls)])
    out = [ChatChunkChoice(index=i, delta=ChatDelta(content=rest))] if rest else []
    out.append(ChatChunkChoice(index=i, delta=whole, logprobs=logprobs, finish_reason="tool_calls"))
    return out


def _split(text: str, meta: ResponseMeta) -> tuple[str | None, str | None]:
    """A whole reply's reasoning (None unless split and sent) and content."""
    if meta.reasoning is None:
        return None, text
    reasoning, content = split(text, meta.reasoning.opened)
    return (reasoning if meta.reasoning.include else None), content


def _calls(text: str, finish_reason: str | None, meta: ResponseMeta) -> list[Any] | None:
    """A finished reply's function calls when the request asked for calls, else None."""
    if meta.tool_choice is None or finish_reason != "stop":
        return None
    return tool_calls_of(text, meta.tool_choice)


def _calls_reason(meta: ResponseMeta) -> str:
    """OpenAI's finish_reason for a reply of calls: "tool_calls" where the model chose the
    functions ("required"), "stop" where the request named it."""
    return "tool_calls" if meta.tool_choice == "required" else "stop"


def _whole(index: int, call: Any) -> DeltaToolCall:
    function = DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments)
    return DeltaToolCall(index=index, id=call.id, type="function", function=function)
