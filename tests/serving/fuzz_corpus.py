"""A bounded corpus of hostile request bodies, and how to judge the server's answer to each.

Each case changes one field of a valid request to a hostile value (a wrong type, a huge or tiny
number, NaN or Infinity, a lone surrogate, a long or deep value, an out-of-range token id), or
sends a whole body that is not a JSON object at all (invalid UTF-8, deep nesting, a 5,000-digit
number, an oversized body). A good answer is a 200, or a 4xx in OpenAI's error shape that names
the field at fault; a 5xx, a vague 4xx or no answer at all is a defect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
RESPONSES = "/v1/responses"
BASE = {"prompt": "fuzz", "max_tokens": 2}  # every case starts from this (or its chat twin)
CHAT_BASE = {"messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 2}
RESPONSES_BASE = {"input": "fuzz", "max_output_tokens": 2}

# JSON texts of hostile values, tried in every field.
VALUES = [
    '"a string"',
    '""',
    "true",
    "{}",
    "[]",
    "[[[[]]]]",
    "-1",
    "0",
    "1.5",
    "1e308",
    "-1e308",
    "5e-324",
    "1e999",  # Python's json reads this as inf
    "NaN",
    "Infinity",
    "-Infinity",
    "9223372036854775808",  # 2**63
    "-9223372036854775809",
    "18446744073709551617",  # 2**64 + 1
    '"\\ud800"',  # a lone surrogate
    '["\\udfff"]',
    '{"\\ud800": 1}',
    '"' + "x" * 20_000 + '"',
]
COMPLETION_FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "stream",
    "stream_options",
    "num_speculative_tokens",
    "logit_bias",
    "presence_penalty",
    "logprobs",
    "echo",
    "prompt_logprobs",
    "guided_choice",
    "guided_regex",
    "guided_json",
    "structured_outputs",
    "tools",
    "tool_choice",
    "best_of",
]
# Values only some fields meet: token ids out of range, long stop lists, nested prompts.
SPECIAL = [
    ("prompt", "[-1]"),
    ("prompt", "[300]"),
    ("prompt", "[9223372036854775808]"),
    ("prompt", "[[1, 2], [-5]]"),
    ("prompt", "[[]]"),
    ("prompt", '["ok", 5]'),
    ("stop_token_ids", "[18446744073709551617]"),
    ("stop_token_ids", "[-1]"),
    ("guided_regex", json.dumps("(a|b)*a(a|b){2000}")),  # counted: at most 64 counts open
    ("guided_regex", json.dumps("(a|b)*a(a|b){200000}")),  # past the largest bound: refused
    ("guided_regex", json.dumps("[\\ud800]")),
    ("guided_json", json.dumps({"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"})),
    ("guided_json", json.dumps({"properties": [], "additionalProperties": 5})),  # wrong types
    ("guided_json", json.dumps({"type": "string", "minLength": "x", "pattern": "a+"})),
    ("guided_json", json.dumps({"type": "integer", "minimum": 1e300, "maximum": "2"})),
    ("guided_json", json.dumps({"type": "array", "prefixItems": [5], "minItems": "a"})),
    ("guided_json", json.dumps({"$ref": "#/properties/none"})),
    ("guided_json", json.dumps({"type": "number", "minimum": 10**40, "maximum": 10**41 + 0.5})),
    ("structured_outputs", json.dumps({"json_object": True})),
    ("stop", json.dumps(["x" * 3000] * 1000)),  # 3 MB of stop strings: refused, not run
    ("stop", json.dumps([f"s{i}" for i in range(10_000)])),
    ("stream_options", '{"include_usage": "yes"}'),
    ("n", "128"),
    ("temperature", "1e-45"),
    ("temperature", "1e-320"),
]
CHAT_VALUES = [
    ("messages", '[{"role": "user", "content": ' + v + "}]") for v in VALUES
] + [
    ("messages", '[{"role": ' + v + ', "content": "x"}]') for v in VALUES
] + [
    ("messages", '[{"role": "user", "content": [{"type": "text", "text": ' + v + "}]}]")
    for v in VALUES
] + [
    ("messages", v) for v in VALUES
]  # fmt: skip
RESPONSES_VALUES = [
    (f, v)
    for f in (
        "input", "instructions", "max_output_tokens", "text", "store", "metadata",
        "previous_response_id", "background", "tools", "tool_choice", "reasoning", "truncation",
        "parallel_tool_calls", "temperature",
    )
    for v in VALUES
] + [
    ("input", '[{"role": "user", "content": [{"type": "input_text", "text": ' + v + "}]}]")
    for v in VALUES
] + [
    ("text", '{"format": {"type": "json_schema", "name": "x", "schema": ' + v + "}}")
    for v in VALUES
]  # fmt: skip
# Whole bodies, and the status each must get (the field is None: no single field is at fault).
BODIES: list[tuple[str, bytes, int]] = [
    ("invalid UTF-8", b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400),
    ("a lone continuation byte", b'{"prompt": "a\x80b"}', 400),
    ("nested 100,000 deep", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    ("nested 900 deep", b'{"prompt": "x", "logit_bias": ' + b"[" * 900 + b"]" * 900 + b"}", 400),
    ("a 5,000-digit integer", b'{"prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}", 400),
    ("truncated", b'{"prompt": "x", "max_tok', 400),
    ("a byte-order mark", b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 2}', 200),  # JSON allows it
    ("null", b"null", 400),
    ("a number", b"3", 400),
    ("a string", b'"prompt"', 400),
    ("an array", b"[]", 400),
    ("empty", b"", 400),
    ("oversized", b'{"prompt": "' + b"x" * (5 * 2**20) + b'"}', 413),
]


@dataclass(frozen=True, slots=True)
class Case:
    name: str  # what is hostile about it
    path: str  # the route it is sent to
    body: bytes  # the raw request body
    field: str | None  # the field a 4xx must name (None: a body-level error)
    status: int | None = None  # the status it must get; None: a 200 or a 4xx naming `field`


def corpus() -> list[Case]:
    """Every case, in a fixed order."""
    cases = []
    specials = [(f, v) for f in COMPLETION_FIELDS for v in VALUES] + SPECIAL
    for field, value in specials:
        body = json.dumps({k: v for k, v in BASE.items() if k != field})[:-1]
        body += f', "{field}": {value}}}'
        cases.append(Case(f"{field} = {value[:40]}", COMPLETIONS, body.encode(), field))
    for field, value in CHAT_VALUES:
        body = json.dumps({k: v for k, v in CHAT_BASE.items() if k != field})[:-1]
        body += f', "{field}": {value}}}'
        cases.append(Case(f"chat {field} = {value[:40]}", CHAT, body.encode(), field))
    for field, value in RESPONSES_VALUES:
        body = json.dumps({k: v for k, v in RESPONSES_BASE.items() if k != field})[:-1]
        body += f', "{field}": {value}}}'
        cases.append(Case(f"responses {field} = {value[:40]}", RESPONSES, body.encode(), field))
    for name, raw, status in BODIES:
        cases.append(Case(name, COMPLETIONS, raw, None, status))
    return cases


def judge(case: Case, status: int, body: bytes) -> str:
    """The outcome of ``case``: "ok", "clear 4xx", "vague 4xx" or "5xx"."""
    if status >= 500:
        return "5xx"
    if status == 200:
        return "ok" if case.status in (None, 200) else "vague 4xx"
    try:
        error = json.loads(body)["error"]
        shaped = set(error) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        return "vague 4xx"
    if not shaped or (case.status is not None and status != case.status):
        return "vague 4xx"
    if case.field is None:
        return "clear 4xx" if "error parsing the body" not in error["message"] else "vague 4xx"
    named = (error["param"] or "").split("[")[0].split(".")[0] == case.field
    return "clear 4xx" if named or case.field in error["message"] else "vague 4xx"
