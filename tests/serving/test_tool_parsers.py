"""The tool-call parsers (hermes, mistral, llama3_json, pythonic, qwen3_coder): calls found in
a finished reply, the same calls and text when the reply arrives in deltas split anywhere, and
text handed back whole when it holds no call."""

from __future__ import annotations

import json

import pytest

from specdec.serving.tool_parsers import SYNTAXES, TOOL_CALL_PARSERS, parser_for
from specdec.structured.regex import compile_regex
from tests.test_structural_tag import accepts

NAMES = {  # name -> the arguments' schema (qwen3_coder types its raw values by it)
    "weather": {"type": "object", "properties": {"unit": {"type": "string"},
                "days": {"type": "array"}, "hourly": {"type": "boolean"},
                "lat": {"type": "number"}, "note": {"type": ["string", "null"]}}},
    "clock": None,
}  # fmt: skip
ONE = '<tool_call>{"name": "weather", "arguments": {"unit": "c"}}</tool_call>'
TWO = ONE + '\n<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>'
MISTRAL = '[TOOL_CALLS] [{"name": "weather", "arguments": {"unit": "c"}}, {"name": "clock", "arguments": "{}"}]'
LLAMA = '<|python_tag|>{"name": "weather", "parameters": {"unit": "c"}}; {"name": "clock", "parameters": {}}'
PYTHONIC = '[weather(unit="c"), clock()]'
BOTH = [("weather", {"unit": "c"}), ("clock", {})]
QWEN = (
    "<tool_call>\n<function=weather>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>"
)
QWEN_TYPED = (  # "id" has no schema: text as written
    "<tool_call>\n<function=weather>\n<parameter=unit>\n 12 \n</parameter>\n<parameter=days>\n"
    "[1, 2]\n</parameter>\n<parameter=hourly>\nTRUE\n</parameter>\n<parameter=lat>\n-3.5\n"
    "</parameter>\n<parameter=note>\nnull\n</parameter>\n<parameter=code>\nif a < b:\n"
    '    print("x\\n")\n</parameter>\n<parameter=id>\n12\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=clock>\n'
    "</function>\n</tool_call>"
)
TYPED = {"unit": " 12 ", "days": [1, 2], "hourly": True, "lat": -3.5, "note": None,
         "code": 'if a < b:\n    print("x\\n")', "id": "12"}  # fmt: skip

CASES = {  # syntax -> (reply, content, calls found)
    "hermes": [
        (ONE, None, [("weather", {"unit": "c"})]),
        ("Let me check.\n" + TWO, "Let me check.", BOTH),
        ("No call <tool here.", None, []),
        ("<tool_call>{not json}</tool_call>", None, []),
        ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', None, []),
        ('<tool_call>{"name": "weather", "arguments": "x"}</tool_call>', None, []),
        (ONE[:-5], None, []),  # cut short
        ("", None, []),
    ],
    "mistral": [
        (MISTRAL, None, BOTH),
        ("Sure. " + MISTRAL, "Sure.", BOTH),
        ('[TOOL_CALLS]{"name": "clock", "arguments": {}}', None, [("clock", {})]),
        ("[TOOL_CALLS] [{", None, []),
        ('[TOOL_CALLS] [{"name": "nope", "arguments": {}}]', None, []),
        ("just [TOOL text", None, []),
    ],
    "llama3_json": [
        (LLAMA, None, BOTH),
        (' {"name": "clock", "arguments": {}}', None, [("clock", {})]),
        ('{"name": "clock", "parameters": {}} and more', None, []),
        ('Here: {"name": "clock", "parameters": {}}', None, []),  # calls are the whole reply
        ('{"name": "clock", "parameters": [1]}', None, []),
        ("{", None, []),
    ],
    "qwen3_coder": [
        (QWEN, None, [("weather", {"unit": "c"})]),
        ("I'll check.\n\n" + QWEN_TYPED, "I'll check.", [("weather", TYPED), ("clock", {})]),
        (QWEN.replace("weather", "nope"), None, []),
        (QWEN.replace("<parameter=unit>", "unit="), None, []),  # not parameters
        (QWEN[:-4], None, []),  # cut short
        ("<tool_call>\n<function=clock>\n</function>\n</tool_call>", None, [("clock", {})]),
    ],
    "qwen3_xml": [(QWEN, None, [("weather", {"unit": "c"})])],
    "pythonic": [
        (PYTHONIC, None, BOTH),
        ('[weather(unit="c", days=[1, 2])]', None, [("weather", {"unit": "c", "days": [1, 2]})]),
        ("[weather(x)]", None, []),  # positional: not a call this syntax has
        ("[weather(unit=os.environ)]", None, []),  # not a literal
        ("[nope()]", None, []),
        ("[1, 2] are numbers", None, []),
        ("Text, then [clock()]", None, []),
    ],
}


def calls(parsed):  # noqa: ANN001, ANN201
    return [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls]


def test_every_parser_has_cases() -> None:
    assert set(CASES) == set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize(
    ("syntax", "text", "content", "expected"),
    [(syntax, *case) for syntax, cases in CASES.items() for case in cases],
)
def test_parse(syntax: str, text: str, content: str | None, expected: list) -> None:
    parsed = parser_for(syntax, NAMES).parse(text)
    assert calls(parsed) == expected
    if expected:
        assert parsed.content == content and all(
            c.id.startswith("call_") for c in parsed.tool_calls
        )
    else:  # no whole call: the reply is handed back as it is
        assert parsed.content == text


@pytest.mark.parametrize(
    ("syntax", "text"), [(syntax, case[0]) for syntax, cases in CASES.items() for case in cases]
)
def test_a_stream_split_anywhere_gives_what_the_whole_reply_gives(syntax: str, text: str) -> None:
    parser = parser_for(syntax, NAMES)
    whole = parser.parse(text)
    for cut in range(len(text) + 1):
        for second in (cut, min(cut + 3, len(text))):
            stream = parser.stream()
            sent = stream.feed(text[:cut]) + stream.feed(text[cut:second])
            sent += stream.feed(text[second:])
            start = parser.calls_start(text)
            if start is not None:  # nothing of a call (nor the space before it) is sent
                assert sent == text[:start].rstrip()
            end = stream.finish()
            assert calls(end) == calls(whole)
            if whole.tool_calls:
                assert sent + (end.content or "") == (whole.content or "")
            else:
                assert sent + (end.content or "") == text


def test_a_stream_cut_short_flushes_what_it_held() -> None:
    stream = parser_for("hermes", NAMES).stream()
    assert stream.feed("Hi <tool_ca") == "Hi"  # a call may be starting: held back, and the
    assert stream.feed('ll>{"name": "wea') == ""  # space before it
    assert stream.flush() == ' <tool_call>{"name": "wea'
    whole = parser_for("pythonic", NAMES).stream()
    assert whole.feed(" [weath") == ""  # the reply opens a list: held
    assert whole.flush() == " [weath"


def test_whitespace_waits_for_what_follows() -> None:
    stream = parser_for("hermes", NAMES).stream()
    assert stream.feed("Hello ") == "Hello"
    assert stream.feed("world.\n") == " world."
    assert stream.finish().content == "\n"  # no call followed: the reply as it is


def test_a_reply_that_opens_with_text_streams_at_once_under_whole_reply_syntaxes() -> None:
    stream = parser_for("llama3_json", NAMES).stream()
    assert stream.feed(" ") == ""  # may still open calls
    assert stream.feed("The ") == " The "  # it does not: text from now on
    assert stream.feed('{"name": "clock"}') == '{"name": "clock"}'
    assert stream.finish().content is None and not stream.calls


def test_llama3_json_strict_tag_holds_the_whole_reply_to_calls_or_to_text():
    """With a strict tool, a llama3_json reply is either calls, each to its function's schema
    and all of them read back by the parser, or text that cannot be taken for a call."""
    unit = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
    tag = SYNTAXES["llama3_json"].strict([("weather", unit), ("clock", {"type": "object"})])
    tag = tag["structural_tag"]
    calls = '{"name": "weather", "parameters": {"unit": "c"}}; {"name": "clock", "parameters": {}}'
    for reply in (calls, calls.split("; ")[0], '{"name": "clock", "parameters": {"a": [1]}}'):
        assert accepts(tag, reply), reply
        assert parser_for("llama3_json", NAMES).parse(reply).tool_calls
    for text in ("It is sunny.", "  Maybe later {ok}", ""):
        assert accepts(tag, text), text
        assert not parser_for("llama3_json", NAMES).parse(text).tool_calls
    for bad in (
        calls.replace('"c"', '"k"'),  # the schema's enum
        '{"name": "nope", "parameters": {}}',  # no such tool
        '{"name": "clock", "parameters": {}} and then text',
        '{"weather": 1}',  # opens like a call, is none
        calls.replace("; ", ";"),
    ):
        assert not accepts(tag, bad), bad


def test_pythonic_strict_guide_holds_each_call_to_its_schema_as_python_literals():
    """With a strict tool, a pythonic reply is either a list of calls whose keyword arguments
    the schemas accept (Python's True, False, None; nested dicts and lists), each read back by
    the parser as those arguments, or text that opens no list."""
    unit = {"type": "object", "properties": {
        "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1},
        "exact": {"type": "boolean"}, "where": {"type": ["object", "null"]},
        "level": {"enum": [1, None, {"a": [True]}]}},
        "required": ["unit"]}  # fmt: skip
    guide = SYNTAXES["pythonic"].strict([("weather", unit), ("clock", {"type": "object"})])
    dfa = compile_regex(guide["regex"])
    parser = parser_for("pythonic", NAMES)
    good = {
        '[weather(unit="c")]': [{"unit": "c"}],
        '[weather(unit="c", level=None)]': [{"unit": "c", "level": None}],
        '[weather(unit="c", level={"a": [True]})]': [{"unit": "c", "level": {"a": [True]}}],
        '[weather(unit="f", days=3, exact=True, where=None), clock()]': [
            {"unit": "f", "days": 3, "exact": True, "where": None}, {}],
        '[weather(unit="c", where={"city": "Paris", "ids": [1, false]}), clock(tz="UTC", x=1.5)]':
            None,  # JSON's false inside a free-form value is no Python literal: see below
        '[weather(unit="c", where={"city": "Paris", "ids": [1, False]}), clock(tz="UTC", x=1.5)]': [
            {"unit": "c", "where": {"city": "Paris", "ids": [1, False]}}, {"tz": "UTC", "x": 1.5}],
    }  # fmt: skip
    for reply, arguments in good.items():
        assert bool(dfa.fullmatch(reply)) == (arguments is not None), reply
        if arguments is not None:
            calls = parser.parse(reply).tool_calls
            assert [json.loads(c.function.arguments) for c in calls] == arguments
    for text in ("It is sunny.", "  Not [a call]", ""):
        assert dfa.fullmatch(text) and not parser.parse(text).tool_calls, text
    for bad in (
        '[weather(unit="k")]',  # the schema's enum
        "[weather(days=2)]",  # unit is required
        '[weather(unit="c", days=0)]',  # minimum
        '[weather(unit="c", exact=true)]',  # JSON's true is no Python literal
        '[weather(days=2, unit="c")]',  # the schema's order
        "[nope()]",
        '[weather(unit="c", level=null)]',
        '[weather(unit="c", level={"a": [true]})]',
        '[weather(unit="c")] and more',
    ):
        assert not dfa.fullmatch(bad), bad
    with pytest.raises(ValueError, match="'my-key' is not a Python identifier"):
        SYNTAXES["pythonic"].strict([("f", {"properties": {"my-key": {}}})])
