"""OpenAI's function calling on guided decoding, as vLLM serves it without a model-specific
parser: ``tool_choice`` naming a function makes the reply that function's arguments, JSON its
``parameters`` schema accepts; ``"required"`` makes it a JSON array of one call or more,
``[{"name": ..., "parameters": {...}}, ...]``, each call's arguments following its own
function's schema. The reply is then handed back as ``tool_calls``, not text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from specdec.serving.errors import APIError
from specdec.serving.responses import FunctionCall, ToolCall
from specdec.serving.strict import StrictModel

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # a function without any


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments; None: none
    # OpenAI's: the arguments follow the schema (always under "required" or a named function; under
    # "auto" too where the server's tool-call parser has a structural tag: see strict_calls)
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class ToolChoiceRules:
    """What ``tool_choice`` means, for a request body with ``tools`` (chat completions' and the
    Responses API's, whose tools differ in shape only)."""

    if TYPE_CHECKING:
        tools: list[Any] | None
        tool_choice: Any

    @property
    def calls_tools(self) -> bool:
        """Whether the reply is function calls (tool_choice "required" or a named function)."""
        return self.tool_choice not in (None, "none", "auto")

    @property
    def auto_tools(self) -> bool:
        """Whether the model decides whether to call (tool_choice "auto", the default with
        tools): then the server's tool-call parser reads its calls, see tool_parsers.py."""
        return bool(self.tools) and self.tool_choice in (None, "auto")


def check_tool_choice(value: Any, names: list[str], named: str | None, given: list[str]) -> None:
    """Refuse a ``tool_choice`` that cannot be served: calls without tools, a named function
    that is not among them, or calls beside another guide (``given``: the fields that gave one).
    "auto" takes a guide: the parser reads whatever text the guide lets through."""
    if value not in (None, "none", "auto") and not names:
        raise ValueError("needs tools: give the functions to call")
    if named is not None and named not in names:
        raise ValueError(f"names {named!r}, which is not among the tools")
    if value not in (None, "none", "auto") and given:
        raise ValueError(f"give one of {given[0]} and tool_choice, not both")


def _parameters(tool: Any) -> dict[str, Any]:
    return tool.function.parameters or NO_PARAMETERS


def _named(tool_choice: Any) -> str | None:
    """The function a named tool_choice calls; None for "required"."""
    return None if isinstance(tool_choice, str) else tool_choice.function.name


def calls_schema(tools: list[Any], tool_choice: Any) -> dict[str, Any]:
    """The JSON Schema the reply must follow under ``tool_choice``."""
    name = _named(tool_choice)
    if name is not None:
        return next(_parameters(t) for t in tools if t.function.name == name)
    one_call = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    return {"type": "array", "items": {"anyOf": one_call}, "minItems": 1}


def strict_calls(
    tools: list[Any], tag: Callable[[list[tuple[str, dict[str, Any]]]], dict[str, Any]]
) -> dict[str, Any] | None:
    """Under "auto", where any tool is ``strict``: the guide that holds each call the model
    makes to its syntax (``tag``, the parser's: see tool_parsers.Syntax.strict) and its
    function's schema (any JSON object for a tool that is not strict), the text around the calls
    free; None where no tool is strict. SGLang's rule: OpenAI's ``strict`` promises arguments
    that follow the schema, whether the model had to call or chose to."""
    if not any(t.function.strict for t in tools):
        return None
    schemas = [
        (t.function.name, _parameters(t) if t.function.strict else {"type": "object"})
        for t in tools
    ]
    try:
        return tag(schemas)
    except ValueError as e:  # a schema the syntax cannot hold (pythonic: no keyword)
        raise APIError(400, str(e), param="tools") from None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_of(text: str, tool_choice: Any) -> list[ToolCall] | None:
    """The calls a finished reply makes; None where it is not whole (cut by ``max_tokens``)."""
    name = _named(tool_choice)
    try:  # the JSON value, and none of the text after it (an end-of-sequence token's own text)
        parsed, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None
    if name is not None:
        arguments = text[:end]
        return [ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))]
    return [
        ToolCall(
            id=new_call_id(),
            function=FunctionCall(
                name=call["name"], arguments=json.dumps(call["parameters"], ensure_ascii=False)
            ),
        )
        for call in parsed
    ]


def parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier call from a conversation's history with its ``arguments`` as an object where
    the JSON text parses: chat templates (transformers') read them that way."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
