"""Qwen3-Coder's tool calls (vLLM's ``qwen3_coder`` and ``qwen3_xml`` parsers): each call
between ``<tool_call>`` and ``</tool_call>`` as::

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>

A value is raw text, so code needs no escaping; it is read as its parameter's schema types it
(:func:`typed`). :func:`xml_guide` is the structural tag that holds each call to that layout and
its function's schema, for strict tools under tool_choice "auto".
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from specdec.structured.json_strings import FORMATS

FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*)</function>\s*", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)
KEY = re.compile(r"[^>\s]+")  # a parameter's name, as PARAMETER reads it
TEXT = {"type": "any_text", "excluded_str": ["</parameter>"]}  # a string value
ANNOTATIONS = {"type", "title", "description", "default", "examples"}
NOTHING = {"type": "const_string", "value": ""}  # an optional parameter left out


def read_function(block: str, tools: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The function a ``<tool_call>`` block calls and its arguments, typed by its schema in
    ``tools`` (name -> the arguments' schema); None where the block is not that layout."""
    function = FUNCTION.fullmatch(block)
    if function is None:
        return None
    name, body = function.groups()
    if PARAMETER.sub("", body).strip():  # something other than parameters
        return None
    root = tools.get(name) or {}
    properties = root.get("properties", {}) if isinstance(root, dict) else {}
    arguments = {
        key: typed(value.removeprefix("\n").removesuffix("\n"), properties.get(key), root)
        for key, value in PARAMETER.findall(body)
    }
    return name, arguments


def kinds(schema: Any, root: Any) -> set[str]:  # noqa: ANN401
    """The JSON types a parameter's schema allows (``$ref`` followed within ``root``, ``anyOf``
    and ``oneOf`` joined); a string where it does not say."""
    if not isinstance(schema, dict):
        return {"string"}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/") and isinstance(root, dict):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        return kinds(target, None) if target is not None else {"string"}
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    options = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(options, list) and options:
        return set().union(*(kinds(option, root) for option in options))
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values:
        return {"string" if isinstance(v, str) else "other" for v in values}
    return {"string"}


def typed(value: str, schema: Any, root: Any) -> Any:  # noqa: ANN401
    """A raw value as its parameter's schema types it: a string as written (where the schema
    allows a string, or says nothing); else the JSON (or Python literal) it spells, kept as
    written where it spells none."""
    allowed = kinds(schema, root)
    if "string" in allowed and not (value.strip() == "null" and "null" in allowed):
        return value
    if "boolean" in allowed and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    for read in (json.loads, ast.literal_eval):
        try:
            return read(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return value


def xml_guide(tools: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Each call as Qwen3-Coder's template writes it: ``<tool_call>\\n<function=NAME>\\n``, a
    ``<parameter=KEY>\\n...\\n</parameter>\\n`` block per argument in its schema's order
    (required ones always, others where the model chooses), ``</function>\\n</tool_call>``; a
    value raw text where its property is a string (no ``</parameter>`` in it; an ``enum``,
    ``const``, ``pattern`` or ``format`` kept), else JSON its schema accepts. A tool that is not
    strict takes any parameters. ValueError for a schema this layout cannot hold."""
    tags = [
        {
            "begin": f"<tool_call>\n<function={name}>\n",
            "content": _parameters(name, schema),
            "end": "</function>\n</tool_call>",
        }
        for name, schema in tools
    ]
    format = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags}
    return {"structural_tag": {"type": "structural_tag", "format": format}}


def _parameters(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    if schema == {"type": "object"}:  # not strict: the parser judges
        return {"type": "any_text", "excluded_str": ["</function>"]}
    required = set(schema.get("required", []))
    elements: list[dict[str, Any]] = []
    for key, prop in schema.get("properties", {}).items():
        if KEY.fullmatch(key) is None:
            raise ValueError(f"tool {name!r}: parameter {key!r} cannot be written as qwen3_coder")
        value = _value(name, key, prop, schema)
        block = {"type": "tag", "begin": f"<parameter={key}>\n", "content": value,
                 "end": "\n</parameter>\n"}  # fmt: skip
        elements.append(block if key in required else {"type": "or", "elements": [block, NOTHING]})
    return {"type": "sequence", "elements": elements} if elements else NOTHING


def _value(name: str, key: str, prop: Any, root: dict[str, Any]) -> dict[str, Any]:  # noqa: ANN401
    """A parameter's value: raw text for a string, else JSON of its schema."""
    if "string" not in kinds(prop, root):
        defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
        return {"type": "json_schema", "json_schema": {**prop, **defs}}
    if not isinstance(prop, dict) or set(prop) <= ANNOTATIONS or kinds(prop, root) != {"string"}:
        return TEXT
    if "enum" in prop or "const" in prop:
        values = prop.get("enum", [prop.get("const")])
        return {"type": "or", "elements": [{"type": "const_string", "value": v} for v in values]}
    if "pattern" in prop and set(prop) <= ANNOTATIONS | {"pattern"}:
        return {"type": "regex", "pattern": prop["pattern"]}
    if prop.get("format") in FORMATS and set(prop) <= ANNOTATIONS | {"format"}:
        return {"type": "regex", "pattern": FORMATS[prop["format"]]}
    others = sorted(set(prop) - ANNOTATIONS)
    raise ValueError(
        f"tool {name!r}: parameter {key!r}: {', '.join(others)} cannot be held in qwen3_coder's "
        "raw text (enum, const, pattern and format can)"
    )
