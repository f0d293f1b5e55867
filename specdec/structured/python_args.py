"""A function's JSON Schema as the keyword arguments of a Python call, ``f(city="Paris",
days=3)``: what the ``pythonic`` tool-call syntax (Llama 3.2 and 4) writes, so that a strict
tool's calls in it can be guided as JSON ones are.

The values are Python literals that read back as the JSON the schema accepts: JSON's own syntax
(``ast.literal_eval`` reads its strings, numbers, lists and objects as Python's) but for
``True``, ``False`` and ``None``. Each property is a keyword, in the schema's order, required
ones always; a property whose name is no Python identifier cannot be a keyword and is refused.
"""

from __future__ import annotations

import json
import re
from typing import Any

from specdec.structured.json_schema import (
    SCALARS,
    WHITESPACE,
    SchemaBuilder,
    free_json_regex,
    loaded_schema,
    members_regex,
    well_formed,
)

PYTHON_SCALARS = {**SCALARS, "boolean": "(?:True|False)", "null": "None"}
IDENTIFIER = "[A-Za-z_][A-Za-z_0-9]*"


def _python_literal(value: Any) -> str:  # noqa: ANN401 - any JSON value
    """``value`` written as a Python literal (JSON's spelling but for True, False, None)."""
    if value is True or value is False or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (
            f"{json.dumps(k, ensure_ascii=False)}: {_python_literal(v)}" for k, v in value.items()
        )
        return "{" + ", ".join(items) + "}"
    return json.dumps(value, ensure_ascii=False)


class _PythonBuilder(SchemaBuilder):
    scalars = PYTHON_SCALARS
    literal = staticmethod(lambda value: re.escape(_python_literal(value)))


def keyword_arguments_regex(schema: dict[str, Any] | bool | str) -> str:
    """The pattern of the keyword arguments (what goes between a call's brackets) whose values
    the object schema ``schema`` accepts; any keywords and literals where it lists no
    properties."""
    schema = loaded_schema(schema)
    builder, w = _PythonBuilder(schema, WHITESPACE), WHITESPACE
    if schema is True or schema == {}:
        schema = {"type": "object"}
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise ValueError("a pythonic call's arguments must be an object schema")
    properties = schema.get("properties")
    if properties is None:  # any keywords, any values
        value = free_json_regex(w=w, scalars=PYTHON_SCALARS)
        keyword = f"{IDENTIFIER}={value}"
        return f"(?:{keyword}(?:{w},{w}{keyword})*)?"
    with well_formed():
        required = set(schema.get("required", []))
        for name in properties:
            if not re.fullmatch(IDENTIFIER, name):
                raise ValueError(f"property {name!r} is not a Python identifier: not a keyword")
        missing = required - set(properties)
        if missing:
            raise ValueError(f"json_schema requires {sorted(missing)[0]!r}, not in properties")
        members = [
            (f"{name}={builder.value(sub, 0)}", name in required)
            for name, sub in properties.items()
        ]
    return members_regex(members, w)
