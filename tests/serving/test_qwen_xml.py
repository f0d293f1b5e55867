"""Qwen3-Coder's XML tool calls (serving/qwen_xml.py): raw values typed by their schemas, and
the strict guide: every call it lets the model write, the parser reads back as arguments the
schema accepts; what the schema refuses, it does not let through."""

from __future__ import annotations

import json

import pytest

from specdec.serving.qwen_xml import kinds, typed, xml_guide
from specdec.serving.tool_parsers import parser_for
from tests.test_structural_tag import accepts

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1},
        "hourly": {"type": "boolean"},
        "at": {"$ref": "#/$defs/Place"},
        "note": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "day": {"type": "string", "format": "date"},
    },
    "required": ["city", "unit"],
    "$defs": {"Place": {"type": "object", "properties": {"lat": {"type": "number"}},
                        "required": ["lat"]}},
}  # fmt: skip
TOOLS = {"weather": WEATHER, "clock": {"type": "object"}}


def call(name: str, **values: str) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_values_are_typed_by_their_schemas():
    assert kinds(WEATHER["properties"]["at"], WEATHER) == {"object"}
    assert kinds(WEATHER["properties"]["note"], WEATHER) == {"integer", "null"}
    assert kinds(WEATHER["properties"]["unit"], WEATHER) == {"string"}
    assert kinds({"enum": [1, 2]}, None) == {"other"} and kinds(None, None) == {"string"}
    assert typed("12", {"type": "integer"}, None) == 12
    assert typed("12", {"type": "string"}, None) == "12"
    assert typed("null", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None) is None
    assert typed("{'a': 1}", {"type": "object"}, None) == {"a": 1}  # a Python literal
    assert typed("not json", {"type": "object"}, None) == "not json"  # kept as written


def test_the_strict_guide_holds_each_call_to_its_schema():
    tag = xml_guide([("weather", WEATHER), ("clock", {"type": "object"})])["structural_tag"]
    parser = parser_for("qwen3_coder", TOOLS)
    good = {
        call("weather", city="Paris", unit="c"): {"city": "Paris", "unit": "c"},
        "Let me look.\n" + call("weather", city="New\nYork <b>", unit="f", days="3",
                                hourly="true", at='{"lat": 1.5}', note="null",
                                day="2024-02-29"): {
            "city": "New\nYork <b>", "unit": "f", "days": 3, "hourly": True, "at": {"lat": 1.5},
            "note": None, "day": "2024-02-29"},
        call("clock", tz="UTC", anything="x y"): {"tz": "UTC", "anything": "x y"},
    }  # fmt: skip
    for reply, arguments in good.items():
        assert accepts(tag, reply), reply
        (found,) = parser.parse(reply).tool_calls
        assert json.loads(found.function.arguments) == arguments
    assert accepts(tag, "No call here.") and accepts(tag, "")
    for bad in (
        call("weather", unit="c", city="Paris"),  # the schema's order
        call("weather", city="Paris"),  # unit is required
        call("weather", city="Paris", unit="k"),  # the enum
        call("weather", city="Paris", unit="c", days="0"),  # minimum
        call("weather", city="Paris", unit="c", days="two"),
        call("weather", city="Paris", unit="c", at='{"lon": 1}'),  # the $ref's required
        call("weather", city="a</parameter>b", unit="c"),  # would end the value early
        call("weather", city="Paris", unit="c", day="2024-13-01"),
        call("nope", city="Paris"),
        call("weather", city="Paris", unit="c", extra="1"),
    ):
        assert not accepts(tag, bad), bad


def test_schemas_the_layout_cannot_hold_are_refused():
    for prop, message in (
        ({"type": "string", "maxLength": 5}, "maxLength cannot be held"),
        ({"type": "string", "minLength": 1, "pattern": "a+"}, "minLength, pattern cannot be held"),
    ):
        with pytest.raises(ValueError, match=message):
            xml_guide([("f", {"type": "object", "properties": {"p": prop}})])
    with pytest.raises(ValueError, match="parameter 'a b' cannot be written"):
        xml_guide([("f", {"type": "object", "properties": {"a b": {"type": "string"}}})])
