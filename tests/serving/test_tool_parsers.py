"""The Hermes tool-call parser: calls found in a finished reply, the same calls and text when
the reply arrives in deltas split anywhere, and text handed back whole when it holds no call."""

from __future__ import annotations

import json

import pytest

from specdec.serving.tool_parsers import HermesStream, parse_hermes

NAMES = ["weather", "clock"]
ONE = '<tool_call>{"name": "weather", "arguments": {"unit": "c"}}</tool_call>'
TWO = ONE + '\n<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>'


def calls(parsed):  # noqa: ANN001, ANN201
    return [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls]


@pytest.mark.parametrize(
    ("text", "content", "expected"),
    [
        (ONE, None, [("weather", {"unit": "c"})]),
        ("Let me check.\n" + TWO, "Let me check.", [("weather", {"unit": "c"}), ("clock", {})]),
        ("No call <tool here.", "No call <tool here.", []),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', None, []),
        ('<tool_call>{"name": "weather", "arguments": "x"}</tool_call>', None, []),
        (ONE[:-5], ONE[:-5], []),  # cut short
        ("", "", []),
    ],
)
def test_parse(text: str, content: str | None, expected: list) -> None:
    parsed = parse_hermes(text, NAMES)
    assert calls(parsed) == expected
    if expected:
        assert parsed.content == content and all(
            c.id.startswith("call_") for c in parsed.tool_calls
        )
    else:  # no whole call: the reply is handed back as it is
        assert parsed.content == text


@pytest.mark.parametrize(
    "text", ["Let me check.\n" + TWO, ONE, "plain <tool_ text", "a<", ONE[:-5]]
)
def test_a_stream_split_anywhere_gives_what_the_whole_reply_gives(text: str) -> None:
    whole = parse_hermes(text, NAMES)
    for cut in range(len(text) + 1):
        for second in (cut, min(cut + 3, len(text))):
            stream = HermesStream(NAMES)
            sent = stream.feed(text[:cut]) + stream.feed(text[cut:second])
            sent += stream.feed(text[second:])
            if "<tool_call>" in text:  # nothing of a call (nor the space before it) is sent
                assert sent == text[: text.index("<tool_call>")].rstrip()
            end = stream.finish()
            assert calls(end) == calls(whole)
            if whole.tool_calls:
                assert sent + (end.content or "") == (whole.content or "")
            else:
                assert sent + (end.content or "") == text


def test_a_stream_cut_short_flushes_what_it_held() -> None:
    stream = HermesStream(NAMES)
    assert stream.feed("Hi <tool_ca") == "Hi"  # a call may be starting: held back, and the
    assert stream.feed('ll>{"name": "wea') == ""  # space before it
    assert stream.flush() == ' <tool_call>{"name": "wea'


def test_whitespace_waits_for_what_follows() -> None:
    stream = HermesStream(NAMES)
    assert stream.feed("Hello ") == "Hello"
    assert stream.feed("world.\n") == " world."
    assert stream.finish().content == "\n"  # no call followed: the reply as it is
