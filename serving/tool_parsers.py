"""Parsers of a model's own tool-call syntax, for ``tool_choice: "auto"``.

Under "auto" the model decides whether to call a function, so its reply is free text in which a
parser finds the calls, as vLLM's ``--tool-call-parser`` does. The syntaxes, by vLLM's names:

- ``hermes`` (NousResearch Hermes 2 Pro, Qwen2.5, SmolLM2 and others): each call a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``, after any
  text the model says first.
- ``mistral`` (Mistral 7B Instruct v0.3 and its kin): ``[TOOL_CALLS]`` then a JSON array of such
  objects, after any text. ``[TOOL_CALLS]`` is a special token, so the server keeps special
  tokens in such a reply's text (vLLM does the same).
- ``llama3_json`` (Llama 3.1 and 3.2's JSON calling): the whole reply is one or more objects
  ``{"name": ..., "parameters": {...}}``, separated by ``;``, after an optional
  ``<|python_tag|>``.
- ``pythonic`` (Llama 3.2 and 4's Python-list calling): the whole reply is a list of calls,
  ``[get_weather(city="Paris"), clock()]``, with keyword arguments that are Python literals.
- ``qwen3_coder`` (also ``qwen3_xml``; Qwen3-Coder's): each call between ``<tool_call>`` and
  ``</tool_call>`` as ``<function=NAME>``, then ``<parameter=KEY>`` value ``</parameter>`` for
  each argument, then ``</function>``. A value is raw text (code needs no escaping), read as its
  parameter's schema types it: a string as written, a number, a boolean, null, or JSON.

A reply is taken as calls only when every call parses and names one of the request's tools;
otherwise it is handed back as the text it is, so nothing the model wrote is lost. A stream
passes text through until a call may be starting (a prefix of the opening marker is held back
until the next delta shows what it is; for the whole-reply syntaxes, the reply's first
characters), then holds the rest and parses it once the reply ends: its calls arrive whole in
the last chunk, as "required" calls do. Whitespace is held back until text follows it, so that
a stream's content is the text before the calls without the whitespace that separates them, as
a whole reply's is.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from specdec.serving.qwen_xml import read_function, xml_guide
from specdec.serving.responses import FunctionCall, ToolCall
from specdec.serving.tools import Tool, new_call_id
from specdec.structured.json_schema import STRING
from specdec.structured.python_args import keyword_arguments_regex

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(slots=True)
class ParsedReply:
    """A finished reply: the text before its calls (None when there is none) and the calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Syntax:
    """Where a model's calls are in its reply, and how to read them."""

    # the calls are this marker and what follows it, anywhere in the reply; None: the calls are
    # the whole reply, which then starts with one of ``openers``
    marker: str | None
    # the calls' text (from the marker on, or the whole reply) and the tools (name -> the
    # arguments' schema) -> the calls, or None if any of them does not parse or names no tool
    read: Callable[[str, Mapping[str, Any]], list[ToolCall] | None]
    openers: tuple[str, ...] = ()
    special_tokens: bool = False  # the marker is a special token: keep them in the text
    # [(name, arguments' schema)] -> the guide (SamplingParams' fields: a structural tag, or a
    # regex) that holds each call in the reply to this syntax and its function's schema, the
    # text around the calls free (strict tools under "auto"); None: the syntax has none
    strict: Callable[[list[tuple[str, dict[str, Any]]]], dict[str, Any]] | None = None


def _call(name: Any, arguments: Any, tools: Mapping[str, Any]) -> ToolCall | None:  # noqa: ANN401
    """A call of ``name`` (one of ``tools``) with a JSON object of arguments (or its
    text), else None."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if name not in tools or not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=text))


def _json_calls(objects: Any, tools: Mapping[str, Any]) -> list[ToolCall] | None:  # noqa: ANN401
    """Calls from JSON objects ``{"name", "arguments" or "parameters"}``."""
    calls = []
    for obj in objects:
        if not isinstance(obj, dict):
            return None
        call = _call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})), tools)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _hermes(text: str, tools: Mapping[str, Any]) -> list[ToolCall] | None:
    try:
        objects = [json.loads(block) for block in _HERMES_BLOCK.findall(text)]
    except json.JSONDecodeError:
        return None
    return _json_calls(objects, tools)  # none closed: the reply was cut short


def _mistral(text: str, tools: Mapping[str, Any]) -> list[ToolCall] | None:
    try:
        objects = json.loads(text.removeprefix("[TOOL_CALLS]"))
    except json.JSONDecodeError:
        return None
    return _json_calls(objects if isinstance(objects, list) else [objects], tools)


def _llama3_json(text: str, tools: Mapping[str, Any]) -> list[ToolCall] | None:
    text, decoder, objects, at = text.strip().removeprefix(_PYTHON_TAG), json.JSONDecoder(), [], 0
    while True:
        at = len(text) - len(text[at:].lstrip())
        try:
            obj, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        objects.append(obj)
        rest = text[at:].lstrip()
        if not rest:
            return _json_calls(objects, tools)
        if not rest.startswith(";"):
            return None
        at = len(text) - len(rest) + 1


def _pythonic(text: str, tools: Mapping[str, Any]) -> list[ToolCall] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
                return None
            if any(kw.arg is None for kw in node.keywords):  # **kwargs
                return None
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            call = _call(node.func.id, arguments, tools)
            if call is None:
                return None
            calls.append(call)
        return calls
    except (SyntaxError, ValueError, TypeError):  # not Python, or not literals
        return None


def _qwen3_xml(text: str, tools: Mapping[str, Any]) -> list[ToolCall] | None:
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        found = read_function(block, tools)
        call = None if found is None else _call(*found, tools)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _hermes_tag(tools: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Each call as Hermes-style templates show it (Qwen2.5's, SmolLM2's): ``<tool_call>``, a
    newline, ``{"name": ..., "arguments": ...}`` and a newline before ``</tool_call>``."""
    tags = [
        {
            "begin": f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema},
            "end": "}\n</tool_call>",
        }
        for name, schema in tools
    ]
    format = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags}
    return {"structural_tag": {"type": "structural_tag", "format": format}}


def _llama3_tag(tools: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The whole reply is calls, ``{"name": ..., "parameters": ...}`` separated by ``; `` (as
    the parser reads them), or text that does not open with ``{`` (so it is no call)."""
    tags = [
        {
            "begin": f'{{"name": {json.dumps(name)}, "parameters": ',
            "content": {"type": "json_schema", "json_schema": schema},
            "end": "}",
        }
        for name, schema in tools
    ]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": "; ", "at_least_one": True}
    text = {"type": "regex", "pattern": r"\s*(?:[^{\s][\s\S]*)?"}
    tag = {"type": "structural_tag", "format": {"type": "or", "elements": [calls, text]}}
    return {"structural_tag": tag}


def _pythonic_guide(tools: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The whole reply is a list of calls, ``[f(a=1), g()]``, each with keyword arguments its
    function's schema accepts as Python literals (:mod:`specdec.structured.python_args`), or
    text that does not open with ``[``. One regex (a tool schema nests as a JSON guide with its
    own whitespace does: free-form values two levels, ``$ref`` three)."""
    one = "|".join(f"{re.escape(name)}\\((?:{_keywords(schema)})\\)" for name, schema in tools)
    calls = f"\\[(?:{one})(?:, ?(?:{one}))*\\]"
    return {"regex": f"{calls}|\\s*(?:[^\\[\\s][\\s\\S]*)?"}


def _keywords(schema: dict[str, Any]) -> str:
    """A strict tool's keyword arguments; a loose one's (its schema ``{"type": "object"}``, see
    tools.strict_calls): any text but a parenthesis outside a string, the parser's to judge (a
    pattern of every literal nested as deep as JSON guides nest takes thousands of states)."""
    if schema == {"type": "object"}:
        return f'(?:[^()"]|{STRING})*'
    return keyword_arguments_regex(schema)


SYNTAXES = {
    "hermes": Syntax("<tool_call>", _hermes, strict=_hermes_tag),
    "mistral": Syntax("[TOOL_CALLS]", _mistral, special_tokens=True),
    "llama3_json": Syntax(None, _llama3_json, openers=(_PYTHON_TAG, "{"), strict=_llama3_tag),
    "pythonic": Syntax(None, _pythonic, openers=("[",), strict=_pythonic_guide),
    "qwen3_coder": Syntax("<tool_call>", _qwen3_xml, strict=xml_guide),
    "qwen3_xml": Syntax("<tool_call>", _qwen3_xml, strict=xml_guide),
}
TOOL_CALL_PARSERS = tuple(SYNTAXES)  # the names --tool-call-parser takes


@dataclass(frozen=True, slots=True)
class CallParser:
    """A syntax, for a request's tools."""

    syntax: Syntax
    tools: Mapping[str, Any]  # name -> the arguments' schema

    def parse(self, text: str) -> ParsedReply:
        """The calls in a finished reply, or the whole reply as text when it holds none or a
        call that does not parse or names no given tool."""
        start = self.calls_start(text)
        if start is None:
            return ParsedReply(text)
        calls = self.syntax.read(text[start:], self.tools)
        if calls is None:
            return ParsedReply(text)
        return ParsedReply(text[:start].strip() or None, calls)

    def calls_start(self, text: str) -> int | None:
        """Where the calls would begin in ``text`` (None: nowhere)."""
        marker = self.syntax.marker
        if marker is not None:
            start = text.find(marker)
            return None if start < 0 else start
        head = text.lstrip()
        return len(text) - len(head) if head.startswith(self.syntax.openers) else None

    def stream(self) -> CallStream:
        return CallStream(self)


def parser_for(name: str, tools: Mapping[str, Any]) -> CallParser:
    """The parser of syntax ``name`` for ``tools`` (name -> the arguments' schema)."""
    return CallParser(SYNTAXES[name], tools)


def tool_schemas(tools: list[Tool]) -> dict[str, Any]:
    """A request's tools as :func:`parser_for` takes them: name -> the arguments' schema."""
    return {tool.function.name: tool.function.parameters for tool in tools}


class CallStream:
    """A streamed reply, delta by delta: the text that can be sent now, then the calls."""

    def __init__(self, parser: CallParser):
        self.parser = parser
        self.text = ""  # the reply so far
        self.sent = 0  # characters of it sent as content
        self.held = False  # a call has started: nothing more is sent until the end
        self.plain = False  # (whole-reply syntaxes) the reply did not start with a call
        self.calls: list[ToolCall] = []  # what finish() found

    def feed(self, delta: str) -> str:
        """The content to send for ``delta``: text up to a possible start of a call."""
        self.text += delta
        if self.held:
            return ""
        marker = self.parser.syntax.marker
        if marker is None:
            return self._feed_whole()
        start = self.text.find(marker, self.sent)
        if start >= 0:
            self.held = True
            return self._send(_text_end(self.text, start))
        # whitespace waits for what follows: before a call it is not content
        partial = _partial_start(self.text, marker)
        return self._send(_text_end(self.text, len(self.text) - partial))

    def _feed_whole(self) -> str:
        """For a syntax whose calls are the whole reply: hold its start until it shows whether
        it opens calls; then hold everything, or send everything."""
        if not self.plain:
            head, openers = self.text.lstrip(), self.parser.syntax.openers
            if head.startswith(openers):
                self.held = True
                return ""
            if not head or any(opener.startswith(head) for opener in openers):
                return ""  # may still open calls
            self.plain = True
        return self._send(len(self.text))

    def finish(self) -> ParsedReply:
        """At the end: the calls, and any text not yet sent (all of it, if no call parses)."""
        parsed = self.parser.parse(self.text)
        if not parsed.tool_calls:
            return ParsedReply(self._send(len(self.text)) or None)
        self.calls = parsed.tool_calls
        content = self._send(self.parser.calls_start(self.text) or 0).strip()
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


def _partial_start(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
