"""Parsers of a model's own tool-call syntax, for ``tool_choice: "auto"``.

Under "auto" the model decides whether to call a function, so its reply is free text in which a
parser finds the calls, as vLLM's ``--tool-call-parser`` does. ``hermes`` reads the syntax of
Hermes-style chat templates (NousResearch Hermes 2 Pro, Qwen2.5 and others): each call is a JSON
object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``, after
any text the model says first.

A reply is taken as calls only when every block parses and names one of the request's tools;
otherwise it is handed back as the text it is, so nothing the model wrote is lost. A stream
passes text through until a call may be starting (a prefix of ``<tool_call>`` is held back
until the next delta shows what it is), then holds the rest and parses it once the reply ends:
its calls arrive whole in the last chunk, as "required" calls do. Whitespace is held back
until text follows it, so that a stream's content is the text before the calls without the
whitespace that separates them, as a whole reply's is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from specdec.serving.responses import FunctionCall, ToolCall
from specdec.serving.tools import new_call_id

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOL_CALL_PARSERS = ("hermes",)  # the names --tool-call-parser takes


@dataclass(slots=True)
class ParsedReply:
    """A finished reply: the text before its calls (None when there is none) and the calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def parse_hermes(text: str, tool_names: list[str]) -> ParsedReply:
    """The calls in a finished reply, or the whole reply as text when it holds none or a call
    that does not parse or names no given tool."""
    start = text.find(HERMES_START)
    if start < 0:
        return ParsedReply(text)
    calls = []
    for block in _HERMES_BLOCK.findall(text[start:]):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return ParsedReply(text)
        if not isinstance(call, dict) or call.get("name") not in tool_names:
            return ParsedReply(text)
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, dict):
            return ParsedReply(text)
        function = FunctionCall(
            name=call["name"], arguments=json.dumps(arguments, ensure_ascii=False)
        )
        calls.append(ToolCall(id=new_call_id(), function=function))
    if not calls:  # a call opened and never closed: the reply was cut short
        return ParsedReply(text)
    content = text[:start].strip()
    return ParsedReply(content or None, calls)


class HermesStream:
    """A streamed reply, delta by delta: the text that can be sent now, then the calls."""

    def __init__(self, tool_names: list[str]):
        self.tool_names = tool_names
        self.text = ""  # the reply so far
        self.sent = 0  # characters of it sent as content
        self.held = False  # a call has started: nothing more is sent until the end
        self.calls: list[ToolCall] = []  # what finish() found

    def feed(self, delta: str) -> str:
        """The content to send for ``delta``: text up to a possible start of a call."""
        self.text += delta
        if self.held:
            return ""
        start = self.text.find(HERMES_START, self.sent)
        if start >= 0:
            self.held = True
            return self._send(_text_end(self.text, start))
        # whitespace waits for what follows: before a call it is not content
        return self._send(_text_end(self.text, len(self.text) - _partial_start(self.text)))

    def finish(self) -> ParsedReply:
        """At the end: the calls, and any text not yet sent (all of it, if no call parses)."""
        parsed = parse_hermes(self.text, self.tool_names)
        if not parsed.tool_calls:
            return ParsedReply(self._send(len(self.text)) or None)
        self.calls = parsed.tool_calls
        content = self._send(self.text.find(HERMES_START)).strip()
        return ParsedReply(content or None, parsed.tool_calls)

    def flush(self) -> str:
        """Everything not yet sent, as text (a reply cut short, whose calls are not whole)."""
        return self._send(len(self.text))

    def _send(self, end: int) -> str:
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out


def _text_end(text: str, end: int) -> int:
    """Where ``text[:end]`` ends without its trailing whitespace."""
    return len(text[:end].rstrip())


def _partial_start(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for size in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
        if HERMES_START.startswith(text[-size:]):
            return size
    return 0
