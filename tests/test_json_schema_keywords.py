"""The JSON Schema keywords pydantic and tool definitions use beyond the basic ones: numeric
bounds (against the numbers' values, over every bound shape), ``additionalProperties``,
``prefixItems``, ``$ref`` pointers and string formats; each a guide that takes the documents
the schema accepts and no other."""

import itertools
import json
import random
import re
from decimal import Decimal
from typing import Annotated

import pytest
from pydantic import AnyUrl, BaseModel, ConfigDict, Field, HttpUrl, TypeAdapter, ValidationError

from specdec import SamplingParams
from specdec.structured.json_numbers import number_range
from specdec.structured.json_schema import PLAIN, schema_regex, schema_rules
from specdec.structured.pushdown import PushdownGuide
from specdec.structured.python_args import keyword_arguments_regex
from specdec.structured.regex import compile_regex, parse_regex, render, restrict
from tests.test_grammar import accepted
from tests.test_structured import ALPHABET, PATTERNS

JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?")
CANDIDATES = sorted(
    {str(i) for i in range(-130, 131)}
    | {f"{sign}{whole}.{fraction}" for sign in ("", "-") for whole in (0, 1, 2, 7, 8, 12, 99, 100)
       for fraction in ("0", "5", "25", "05", "50", "001", "1", "24", "26", "999", "0500")}
    | {"-0", "00", "01", "1e2", ".5", "5.", "1.2.3", "+1", "--1", "1.", "", "-"}
)  # fmt: skip
BOUNDS = [None, 0, 1, -1, 0.5, -0.5, 2.25, -2.25, 8, 12.05, 99.999, 100]


def within(text: str, schema: dict, integer: bool) -> bool:
    if JSON_NUMBER.fullmatch(text) is None or (integer and "." in text):
        return False
    value = Decimal(text)
    low, high = schema.get("minimum"), schema.get("maximum")
    low_x, high_x = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    return (
        (low is None or value >= Decimal(str(low)))
        and (high is None or value <= Decimal(str(high)))
        and (low_x is None or value > Decimal(str(low_x)))
        and (high_x is None or value < Decimal(str(high_x)))
    )


@pytest.mark.parametrize("integer", [True, False])
def test_bounded_numbers_are_exactly_those_within_the_bounds(integer):
    """Every pair of bounds (either missing, inclusive or exclusive), every candidate string: the
    pattern matches exactly the numbers whose value is within them (no ``-0``, no exponent)."""
    checked = 0
    for low, high in itertools.product(BOUNDS, BOUNDS):
        for low_key, high_key in itertools.product(
            ("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")
        ):
            schema = {k: v for k, v in ((low_key, low), (high_key, high)) if v is not None}
            allowed = [c for c in CANDIDATES if within(c, schema, integer)]
            allowed = [c for c in allowed if not (c.startswith("-") and Decimal(c) == 0)]  # -0
            try:
                dfa = compile_regex(number_range(schema, integer))
            except ValueError as e:
                assert "allows no" in str(e) and not allowed, schema
                continue
            matched = [c for c in CANDIDATES if dfa.fullmatch(c)]
            assert matched == allowed, schema
            checked += 1
    assert checked > 200


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "integer", "minimum": 3, "maximum": 2}, "allows no number between 3 and 2"),
        ({"type": "integer", "minimum": 2.1, "maximum": 2.9}, "allows no number between 3 and 2"),
        ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "allows no number"),
        ({"type": "number", "minimum": "1"}, "minimum must be a number, got '1'"),
        ({"type": "number", "maximum": float("inf")}, "maximum must be a finite number"),
    ],
)
def test_bounds_that_allow_nothing_are_refused(schema, message):
    with pytest.raises(ValueError, match=message):
        schema_regex(schema)


def test_wide_bounds_make_patterns_as_long_as_their_digits():
    """A bound of n digits is a pattern of O(n^2) characters (splitting a range at each digit
    once; before, a range of full widths split twice a digit: 27 MB for 10^20)."""
    for digits in (20, 300):
        pattern = number_range({"minimum": -(10**digits) + 7, "maximum": 10**digits}, True)
        assert len(pattern) < 10 * digits**2
    dfa = compile_regex(number_range({"minimum": 10**30, "maximum": 3 * 10**31}, True))
    assert dfa.fullmatch(str(10**30)) and dfa.fullmatch(str(3 * 10**31))
    assert not dfa.fullmatch(str(10**30 - 1)) and not dfa.fullmatch(str(3 * 10**31 + 1))
    assert dfa.fullmatch(str(2 * 10**30 + 12345)) and not dfa.fullmatch("0" + str(10**30))


def test_draft_4_boolean_exclusive_bounds_and_the_tighter_of_two():
    dfa = compile_regex(schema_regex({"type": "integer", "minimum": 0, "exclusiveMinimum": True}))
    assert not dfa.fullmatch("0") and dfa.fullmatch("1")
    both = {"type": "number", "maximum": 5, "exclusiveMaximum": 3, "minimum": 1}
    dfa = compile_regex(schema_regex(both))
    assert dfa.fullmatch("2.99") and not dfa.fullmatch("3") and not dfa.fullmatch("0.5")
    dfa = compile_regex(schema_regex({"type": "number", "minimum": 1, "exclusiveMinimum": 0}))
    assert dfa.fullmatch("1") and not dfa.fullmatch("0.5")


class Point(BaseModel):
    x: int
    label: Annotated[str, Field(max_length=6)]


class Survey(BaseModel):  # what a user hands vLLM's response_format
    model_config = ConfigDict(extra="forbid")
    age: Annotated[int, Field(ge=0, le=120)]
    score: Annotated[float, Field(gt=0, lt=1)]
    counts: dict[str, int]
    pair: tuple[int, str]
    points: list[Point]
    rest: dict[str, Point] = {}


GOOD = [
    Survey(age=0, score=0.5, counts={}, pair=(1, "a"), points=[]),
    Survey(age=120, score=0.999, counts={"a": 3, "b": -1}, pair=(-7, ""), points=[Point(x=1, label="p")]),
    Survey(age=33, score=0.01, counts={"x y": 0}, pair=(0, "z"), points=[], rest={"k": Point(x=2, label="q")}),
]  # fmt: skip
BAD = [
    '{"age": 121, "score": 0.5, "counts": {}, "pair": [1, "a"], "points": []}',
    '{"age": -1, "score": 0.5, "counts": {}, "pair": [1, "a"], "points": []}',
    '{"age": 3, "score": 1, "counts": {}, "pair": [1, "a"], "points": []}',
    '{"age": 3, "score": 0, "counts": {}, "pair": [1, "a"], "points": []}',
    '{"age": 3, "score": 0.5, "counts": {"a": "b"}, "pair": [1, "a"], "points": []}',
    '{"age": 3, "score": 0.5, "counts": {}, "pair": [1], "points": []}',
    '{"age": 3, "score": 0.5, "counts": {}, "pair": [1, "a", 2], "points": []}',
    '{"age": 3, "score": 0.5, "counts": {}, "pair": ["a", 1], "points": []}',
    '{"age": 3, "score": 0.5, "counts": {}, "pair": [1, "a"], "points": [{"x": 1}]}',
    '{"age": 3, "score": 0.5, "counts": {}, "pair": [1, "a"], "points": [], "extra": 1}',
]


@pytest.mark.parametrize("guide", ["regex", "pushdown"])
def test_a_pydantic_models_schema_takes_its_documents_and_no_others(make_llm, guide):
    """pydantic's own schema (bounds, ``dict[str, int]``, a tuple, nested models by ``$ref``):
    the model's dumps are accepted, documents it refuses are not."""
    schema = Survey.model_json_schema()
    if guide == "regex":
        check = compile_regex(schema_regex(schema)).fullmatch
    else:  # a free-form value inside makes it the pushdown guide's rules
        schema = {**schema, "properties": {**schema["properties"], "meta": {}}}
        llm = make_llm()
        pushdown = llm.engine.guides.for_params(SamplingParams(json_schema=schema))
        assert isinstance(pushdown, PushdownGuide)

        def check(text: str) -> bool:
            return accepted(pushdown, llm.tokenizer, text)

    for survey in GOOD:
        assert check(survey.model_dump_json()), survey
        assert check(json.dumps(survey.model_dump(mode="json")))  # a space after , and :
    for text in BAD:
        assert not check(text), text
        with pytest.raises(ValidationError):
            Survey.model_validate_json(text)


def test_additional_properties_false_true_and_a_schema():
    def matches(schema: dict, text: str) -> bool:
        return compile_regex(schema_regex(schema)).fullmatch(text)

    closed = {"type": "object", "additionalProperties": False}
    assert matches(closed, "{}") and not matches(closed, '{"a": 1}')
    listed = {"properties": {"a": {"type": "integer"}}, "additionalProperties": True}
    assert matches(listed, '{"a": 1, "b": [true]}') and matches(listed, '{"b": null}')
    assert not matches(listed, '{"a": "x"}')  # "a" is listed: its schema judges it
    assert not matches(listed, '{"a": 1, "a": "x"}') and not matches(listed, '{"\\u0061": "x"}')
    assert matches(listed, '{"aa": "x", "": 1, "\\n": 2}')
    typed = {"properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
    assert matches(typed, '{"a": 1, "b": "x", "c": "y"}') and not matches(typed, '{"b": 2}')
    assert not matches({"properties": {"a": {}}}, '{"a": 1, "b": 2}')  # unspecified: listed only


def test_prefix_items_then_items_within_min_and_max():
    def matches(schema: dict, text: str) -> bool:
        return compile_regex(schema_regex(schema)).fullmatch(text)

    tup = {"prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}
    assert matches(tup, '[1, "a"]') and matches(tup, "[1]") and matches(tup, "[]")
    assert not matches(tup, '[1, "a", 2]') and not matches(tup, '["a"]')
    more = {"prefixItems": [{"type": "integer"}], "items": {"type": "boolean"}, "minItems": 2,
            "maxItems": 3}  # fmt: skip
    assert matches(more, "[1, true]") and matches(more, "[1, true, false]")
    assert not matches(more, "[1]") and not matches(more, "[1, true, true, true]")
    assert not matches(more, "[true, 1]")
    with pytest.raises(ValueError, match="allows no length: 3 to 2 items"):
        schema_regex({**tup, "minItems": 3})


TREE_AT_ROOT = {"type": "object", "properties": {"v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["v"]}  # fmt: skip


def test_refs_to_the_root_and_to_any_pointer(make_llm):
    llm = make_llm()
    tree = llm.engine.guides.for_params(SamplingParams(json_schema=TREE_AT_ROOT))
    assert isinstance(tree, PushdownGuide)
    nested = '{"v": 1, "kids": [' * 15 + '{"v": 2}' + "]}" * 15
    assert accepted(tree, llm.tokenizer, nested)
    assert not accepted(tree, llm.tokenizer, nested.replace('{"v": 2}', '{"kids": []}'))
    pointer = {"properties": {"a": {"type": "array", "items": {"enum": ["x/y", "~"]}},
                              "b": {"$ref": "#/properties/a/items"}}}  # fmt: skip
    dfa = compile_regex(schema_regex(pointer))
    assert dfa.fullmatch('{"a": ["~"], "b": "x/y"}') and not dfa.fullmatch('{"b": "z"}')
    escaped = {"$defs": {"a/b": {"const": 1}, "m~n": {"const": 2}},
               "properties": {"p": {"$ref": "#/$defs/a~1b"}, "q": {"$ref": "#/$defs/m~0n"}}}  # fmt: skip
    assert compile_regex(schema_regex(escaped)).fullmatch('{"p": 1, "q": 2}')
    for ref, message in [
        ("https://example.com/s.json", "only references within the schema"),
        ("#/properties/nope", "names nothing in the schema"),
        ("#/properties/a/type", "does not name a schema"),
    ]:
        with pytest.raises(ValueError, match=message):
            schema_regex({"properties": {"a": {"type": "string"}, "r": {"$ref": ref}}})


@pytest.mark.parametrize(
    "form, good, bad",
    [
        ("email", ["a@b.co", "first.last+tag@mail.example.org"], ["a@b", "@b.co", "a..b@c.de",
                                                                  "a b@c.de", "a@-b.co"]),
        ("hostname", ["localhost", "a-1.example.com"], ["-a.com", "a_b.com", "a..b", ""]),
        ("ipv4", ["0.0.0.0", "192.168.1.255"], ["256.1.1.1", "1.2.3", "01.2.3.4", "1.2.3.4.5"]),
    ],
)  # fmt: skip
def test_string_formats(form, good, bad):
    dfa = compile_regex(schema_regex({"type": "string", "format": form}))
    for text in good:
        assert dfa.fullmatch(json.dumps(text)), text
    for text in bad:
        assert not dfa.fullmatch(json.dumps(text)), text


def test_bounded_guided_generation_stays_within_the_bounds(make_llm):
    """A tiny random model's sampled outputs under ``ge``/``le`` bounds: every one a number
    within them (the guide ends each when the number is whole)."""
    llm = make_llm()
    adapter = TypeAdapter(Annotated[float, Field(ge=-2.5, le=40)])
    params = SamplingParams(
        json_schema=adapter.json_schema(), temperature=1.0, seed=3, max_tokens=12, n=8
    )
    texts = [o.text for out in llm.generate([[5, 6, 7]], params) for o in out.outputs]
    assert len(texts) == 8
    for text in texts:
        assert -2.5 <= adapter.validate_json(text) <= 40, text


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_rendered_tree_is_the_same_pattern_and_a_restricted_one_its_plain_strings(pattern):
    """``render`` gives back a pattern of the same strings; ``restrict`` to the characters a
    JSON string holds unescaped keeps exactly the strings without the others."""
    rng = random.Random(pattern)
    strings = ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(7))) for _ in range(2000)]
    tree = parse_regex(pattern)
    same, plain = compile_regex(render(tree)), restrict(tree, PLAIN)
    cut = compile_regex(render(plain)) if plain is not None else None
    for s in strings:
        full = same.fullmatch(s)
        assert full == bool(re.fullmatch(pattern, s, re.ASCII)), s
        escaped = any(c in '"\\' or ord(c) < 0x20 for c in s)
        assert (cut is not None and cut.fullmatch(s)) == (full and not escaped), s


def test_a_string_pattern_never_writes_what_json_escapes():
    """``.+`` would take a quote into the document; the guide's pattern holds only characters
    written as they are, so every document it takes is JSON whose value matches the pattern."""
    dfa = compile_regex(schema_regex({"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^.+$"}}, "required": ["a"]}))  # fmt: skip
    assert dfa.fullmatch('{"a": "x y!"}') and not dfa.fullmatch('{"a": "x"y"}')
    assert not dfa.fullmatch('{"a": "x\\\\"}') and not dfa.fullmatch('{"a": ""}')
    with pytest.raises(ValueError, match="matches only strings with a character JSON escapes"):
        schema_regex({"type": "string", "pattern": '^"+$'})
    assert compile_regex(schema_regex({"type": "string", "pattern": '"|ab'})).fullmatch('"ab"')
    assert compile_regex(schema_regex({"type": "string", "pattern": 'a"*'})).fullmatch('"a"')


def test_a_pattern_or_format_with_lengths_keeps_both_or_is_refused():
    def matches(schema: dict, text: str) -> bool:
        return compile_regex(schema_regex({"type": "string", **schema})).fullmatch(text)

    word = {"pattern": "^[a-z]+$", "maxLength": 5, "minLength": 2}
    assert matches(word, '"abcde"') and not matches(word, '"abcdef"') and not matches(word, '"a"')
    assert matches({"pattern": "[0-9]{2,9}", "maxLength": 3}, '"123"')
    assert not matches({"pattern": "[0-9]{2,9}", "maxLength": 3}, '"1234"')
    fixed = {"pattern": r"^\d{3}-\d{4}$", "maxLength": 8}  # every string 8 long: as it is
    assert matches(fixed, '"555-1234"')
    assert matches({"format": "date", "minLength": 10, "maxLength": 10}, '"2024-02-29"')
    for schema, message in [
        (
            {"pattern": "^a+b*$", "maxLength": 3},
            "pattern '\\^a\\+b\\*\\$' with minLength/maxLength",
        ),
        ({"format": "email", "maxLength": 30}, "format 'email' with minLength/maxLength"),
        ({"pattern": "[a-z]{6,}", "maxLength": 5}, "has no string of 0 to 5 characters"),
    ]:
        with pytest.raises(ValueError, match=message):
            schema_regex({"type": "string", **schema})
    code = {"pattern": "^[A-Z]{2}-[0-9]+$", "minLength": 5, "maxLength": 7}  # a fixed beginning
    assert matches(code, '"AB-12"') and matches(code, '"AB-1234"')
    assert not matches(code, '"AB-1"') and not matches(code, '"AB-12345"')
    tagged = {"pattern": "^[a-z]{1,3}:[0-9]+$", "maxLength": 6}  # a beginning of 2 to 4
    assert matches(tagged, '"a:12"') and matches(tagged, '"abc:12"')
    assert not matches(tagged, '"a:123"')  # within 6, but not after the longest beginning
    pairs = {"pattern": "^x(ab)+$", "minLength": 4, "maxLength": 8}  # items of 2: whole ones
    assert matches(pairs, '"xabab"') and matches(pairs, '"xababab"')
    assert not matches(pairs, '"xab"') and not matches(pairs, '"xabababab"')


def test_uri_format_and_pydantics_urls(make_llm):
    """``format: uri`` (pydantic's ``AnyUrl``; ``HttpUrl`` adds ``maxLength: 2083``, counted
    rather than unrolled): a common scheme (a host after ``//``), then RFC 3986's characters
    (and percent-escapes where no length is given)."""
    llm = make_llm()

    def matches(schema: dict, text: str) -> bool:
        guide = llm.engine.guides.for_params(SamplingParams(json_schema=schema))
        return accepted(guide, llm.tokenizer, text)

    http = TypeAdapter(HttpUrl).json_schema()
    assert http["format"] == "uri" and http["maxLength"] == 2083
    assert isinstance(llm.engine.guides.for_params(SamplingParams(json_schema=http)), PushdownGuide)
    good = ("https://example.com/a/b?c=d&e=f", "http://[::1]:8080/x", "mailto:a@b.org",
            "s3://bucket/key", "file:///etc/hosts")  # fmt: skip
    for url in good:
        assert matches(http, json.dumps(url)), url
    for bad in ("example.com", "https://a b.com", "https://a.com/%20", "1http://a.com",
                "Wikipedia.::Wikipedia.com", "http:/a.com", "https:///a", "x-y:z"):  # fmt: skip
        assert not matches(http, json.dumps(bad)), bad
    assert matches(http, json.dumps("https://a.io/" + "x" * 2060))  # 2073 characters
    assert not matches(http, json.dumps("https://a.io/" + "x" * 2071))  # 2084
    any_url = TypeAdapter(AnyUrl).json_schema()
    assert matches(any_url, '"https://a.com/caf%C3%A9"') and not matches(any_url, '"a:%zz"')
    HttpUrl(json.loads('"https://example.com/a/b?c=d&e=f"'))  # (the tiny model ends at "#")


def test_keywords_kept_only_where_they_constrain_nothing_else_refused():
    def matches(schema: dict, text: str) -> bool:
        return compile_regex(schema_regex(schema)).fullmatch(text)

    nullable = {"type": "integer", "nullable": True, "contentMediaType": "text/plain"}
    assert matches(nullable, "null") and matches(nullable, "3") and not matches(nullable, '"3"')
    assert matches({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, "[1, 1]")
    assert matches({"type": "array", "uniqueItems": True, "maxItems": 1}, "[1]")
    closed = {"properties": {"a": {}}, "required": ["a"], "additionalProperties": False,
              "minProperties": 1, "maxProperties": 1}  # fmt: skip
    assert matches(closed, '{"a": 1}')
    for schema, message in [
        ({"type": "array", "uniqueItems": True}, "'uniqueItems' is not supported"),
        ({"properties": {"a": {}}, "minProperties": 1}, "minProperties/maxProperties"),
        ({"type": "object", "maxProperties": 3}, "minProperties/maxProperties"),
    ]:
        with pytest.raises(ValueError, match=message):
            schema_regex(schema)


@pytest.mark.parametrize(
    "schema",
    [{"properties": []}, {"properties": {"a": 5}}, {"additionalProperties": 5},
     {"prefixItems": [5]}, {"type": "string", "pattern": 5}, {"required": 5}, {"enum": 5},
     {"type": "string", "minLength": "x", "pattern": "a+"}, {"minProperties": "x"}],
)  # fmt: skip
def test_a_keyword_of_the_wrong_type_is_a_clear_error(schema):
    """Not a TypeError from deep inside (the server's 500): a ValueError that says so, from each
    way a schema is written out (one regex, the pushdown guide's rules, a Python call's)."""
    python = (keyword_arguments_regex,) if "properties" in schema else ()  # its keywords
    for write in (schema_regex, schema_rules, *python):
        with pytest.raises(ValueError, match="malformed|must|not supported"):
            write(schema)
