"""A JSON Schema as a regular expression whose every match is a JSON document the schema
accepts, as Outlines (Willard and Louf 2023) builds one for guided generation.

Objects list their properties in the schema's order: required ones always, optional ones where
the model chooses, then others only where ``additionalProperties`` is true or a schema (keys
other than the listed ones: :func:`~specdec.structured.json_strings.other_key`). Between JSON
tokens at most one space is allowed (:data:`WHITESPACE`), as in Outlines: a small model offered
free whitespace can spend its whole budget on it. JSON itself is not regular:
:func:`schema_rules` writes free-form values (``{}``, ``true``, an object without
``properties``, ``response_format: json_object``) and recursive ``$ref`` targets as rules of
their own, which the pushdown guide follows to any depth, while :func:`schema_regex` (one
pattern: a JSON guide with its own whitespace, ``whitespace_pattern``, becomes a regex) nests
free-form values at most :data:`FREE_DEPTH` deep and ``$ref`` at most :data:`MAX_REF_DEPTH`.

Supported keywords: ``type`` (one or a list), ``properties``, ``required``,
``additionalProperties`` (false, true or a schema), ``propertyNames`` and ``patternProperties``
(on an object without ``properties``), ``items``, ``prefixItems`` (tuples), ``minItems``,
``maxItems``, ``enum``, ``const``, ``anyOf``, ``oneOf``, a one-item ``allOf``, ``minimum``,
``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum`` (:mod:`~specdec.structured.json_numbers`),
``minLength``, ``maxLength``, ``pattern`` (with lengths where
:func:`~specdec.structured.json_strings.within` can keep both), ``format`` (``date``, ``time``,
``date-time``, ``duration``, ``uuid``, ``email``, ``hostname``, ``ipv4``, ``ipv6``, ``uri``;
pydantic's ``ipvanyaddress``; ``path``, ``password`` and ``binary``, any string),
``$ref`` to ``#`` or any JSON pointer within the schema (``#/$defs/node``; recursive ones too),
and the annotations that constrain nothing (``title``, ``description``, ``default``,
``examples``, ``$schema``, ``$id``, ``$comment``, ``readOnly``, ``writeOnly``, ``deprecated``,
``contentEncoding``, ``contentMediaType``, ``$anchor``, OpenAPI's ``discriminator``); OpenAPI's
``nullable``; ``uniqueItems``, ``minProperties`` and ``maxProperties`` where the rest of the
schema already meets them. Any other keyword is refused by name rather than silently ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import unquote

from specdec.structured.json_numbers import number_range
from specdec.structured.json_strings import (
    FORMATS,
    PLAIN_FORMATS,
    STRING,
    STRING_CHAR,
    format_tree,
    other_members,
    within,
)
from specdec.structured.regex import MAX_CODEPOINT, parse_regex, render, restrict

WHITESPACE = r"[ ]?"
PLAIN = [(0x20, 0x21), (0x23, 0x5B), (0x5D, MAX_CODEPOINT)]  # what a JSON string holds unescaped
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
SCALARS = {"string": STRING, "integer": INTEGER, "number": NUMBER,
           "boolean": "(?:true|false)", "null": "null"}  # fmt: skip
FREE_DEPTH = 2  # nesting of free-form objects and arrays
MAX_REF_DEPTH = 3
MAX_NESTING = 64  # schemas within schemas
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
               "$defs", "definitions", "readOnly", "writeOnly", "deprecated", "contentEncoding",
               "contentMediaType", "$anchor", "discriminator"}  # fmt: skip
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
KEYWORDS = ANNOTATIONS | {"type", "properties", "required", "items", "minItems", "maxItems",
                          "enum", "const", "anyOf", "oneOf", "allOf", "minLength", "maxLength",
                          "pattern", "format", "$ref", "additionalProperties", "prefixItems",
                          "nullable", "uniqueItems", "minProperties", "maxProperties",
                          "propertyNames", "patternProperties", *BOUNDS}  # fmt: skip


def schema_regex(schema: dict[str, Any] | bool | str, whitespace: str = WHITESPACE) -> str:
    """The regular expression of ``schema`` (a dict, a boolean, or its JSON text);
    ``whitespace``: the pattern allowed between JSON tokens."""
    with well_formed():
        return SchemaBuilder(loaded_schema(schema), whitespace).value(loaded_schema(schema), 0)


def schema_rules(
    schema: dict[str, Any] | bool | str, whitespace: str = WHITESPACE
) -> tuple[str, ...]:
    """``schema`` as patterns that call each other (``(?&n)``: the n-th), the first the whole
    document's, for the pushdown guide (:mod:`specdec.structured.pushdown`): free-form values
    and recursive ``$ref`` targets are rules of their own, so they nest to any depth. One
    pattern where the schema has neither (it is :func:`schema_regex`'s)."""
    builder = SchemaBuilder(loaded_schema(schema), whitespace, calls=True)
    with well_formed():
        root = builder.value(builder.root, 0)
    return (root, *builder.rules)


@contextmanager
def well_formed() -> Iterator[None]:
    """A keyword whose value has the wrong type (``"properties": []``, ``"minLength": "x"``)
    met while a schema is written out: a ValueError that says so, not a crash."""
    try:
        yield
    except (TypeError, AttributeError) as e:
        raise ValueError(
            f"json_schema is malformed: a keyword's value has the wrong type ({e})"
        ) from None


def loaded_schema(schema: dict[str, Any] | bool | str) -> dict[str, Any] | bool:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be an object, got {type(schema).__name__}")
    return schema


def free_json_regex(
    depth: int = FREE_DEPTH,
    top_object: bool = False,
    w: str = WHITESPACE,
    scalars: dict[str, str] = SCALARS,
) -> str:
    """Any JSON value nested at most ``depth`` levels (an object, if ``top_object``), ``w``
    between its tokens (``scalars``: the scalars' patterns)."""
    any_scalar = "|".join(scalars.values())
    value = f"(?:{any_scalar})"
    for _ in range(depth):
        obj = _object_of(f"{STRING}{w}:{w}{value}", w)
        array = _sequence(value, 0, None, w)
        value = f"(?:{any_scalar}|{obj}|{array})"
    return _object_of(f"{STRING}{w}:{w}{value}", w) if top_object else value


def _object_of(member: str, w: str) -> str:
    return rf"\{{{w}(?:{member}(?:{w},{w}{member})*)?{w}\}}"


def _sequence(item: str, low: int, high: int | None, w: str) -> str:
    """A JSON array of ``low`` to ``high`` (None: any number of) ``item``s, ``w`` between."""
    more = f"(?:{w},{w}{item})"
    if high is not None and high < low:
        raise ValueError(f"maxItems ({high}) is below minItems ({low})")
    if high == 0:
        return rf"\[{w}\]"
    rest = f"{more}{{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
    body = f"{item}{rest}"
    return rf"\[{w}{body}{w}\]" if low > 0 else rf"\[{w}(?:{body})?{w}\]"


def _unconstraining(schema: dict[str, Any]) -> None:
    """Refuse ``uniqueItems`` and ``min/maxProperties`` unless every document the rest of the
    schema allows meets them (a pattern cannot count distinct items or members)."""
    if schema.get("uniqueItems") is True and schema.get("maxItems", 2) > 1:
        raise ValueError("json_schema keyword 'uniqueItems' is not supported (true, with more "
                         "than one item)")  # fmt: skip
    listed, required = schema.get("properties", {}), schema.get("required", [])
    closed = schema.get("additionalProperties") is False
    if schema.get("minProperties", 0) > len(set(required)) or (
        "maxProperties" in schema and not (closed and schema["maxProperties"] >= len(listed))
    ):
        raise ValueError("json_schema minProperties/maxProperties are supported only where the "
                         "required and listed properties already meet them")  # fmt: skip


def _literal(value: Any) -> str:
    return re.escape(json.dumps(value, ensure_ascii=False))


def members_regex(members: list[tuple[str, bool]], w: str) -> str:
    """Members (each a pattern, and whether it is required) in order, the optional ones where
    the model chooses; commas only between the members present."""
    first_required = next((i for i, (_, r) in enumerate(members) if r), len(members))
    options = []
    for first in range(min(first_required + 1, len(members))):
        rest = "".join(f"{w},{w}{m}" if r else f"(?:{w},{w}{m})?" for m, r in members[first + 1 :])
        options.append(members[first][0] + rest)
    body = "|".join(options)
    if first_required == len(members):  # none required
        body = f"(?:{body})?" if body else ""
    return body


class SchemaBuilder:
    scalars = SCALARS  # the scalar types' patterns
    literal = staticmethod(_literal)  # a JSON value's pattern

    def __init__(self, root: dict[str, Any] | bool, whitespace: str, calls: bool = False):
        self.w = f"(?:{whitespace})" if whitespace and whitespace != WHITESPACE else whitespace
        self.root, self.depth = root, 0  # depth: schemas within schemas, now
        self.defs: dict[str, Any] = {}  # the schemas $refs name, by the $ref
        # calls (schema_rules): the rules' patterns (rule n is rules[n - 1]), the rule of each
        # recursive $defs entry and of a free-form value, and the entries being written out
        self.calls, self.rules = calls, list[str]()
        self.called: dict[str, int] = {}
        self.open: list[str] = []

    def free(self, top_object: bool = False) -> str:
        """A free-form value (an object, if ``top_object``)."""
        if not self.calls:
            return free_json_regex(top_object=top_object, w=self.w, scalars=self.scalars)
        if "" not in self.called:  # the free-form value's rule calls itself where it nests
            call = self.rule("")
            obj = _object_of(f"{STRING}{self.w}:{self.w}{call}", self.w)
            scalars = "|".join(self.scalars.values())
            self.rules[self.called[""] - 1] = (
                f"(?:{scalars}|{obj}|{_sequence(call, 0, None, self.w)})"
            )
        call = self.rule("")
        return _object_of(f"{STRING}{self.w}:{self.w}{call}", self.w) if top_object else call

    def rule(self, key: str) -> str:
        """The call of rule ``key`` ("" the free-form value's, else a $defs entry's), numbered
        the first time."""
        if key not in self.called:
            self.rules.append("")
            self.called[key] = len(self.rules)
        return f"(?&{self.called[key]})"

    def value(self, schema: dict[str, Any] | bool, refs: int) -> str:
        self.depth += 1
        try:
            if self.depth > MAX_NESTING:
                raise ValueError(f"json_schema nests more than {MAX_NESTING} deep")
            return self._value(schema, refs)
        finally:
            self.depth -= 1

    def _value(self, schema: dict[str, Any] | bool, refs: int) -> str:
        if schema is True or schema == {}:
            return self.free()
        if schema is False:
            raise ValueError("json_schema false accepts nothing")
        unknown = sorted(set(schema) - KEYWORDS)
        if unknown:
            raise ValueError(f"json_schema keyword {unknown[0]!r} is not supported")
        if schema.get("nullable") is True:  # OpenAPI's: the value, or null
            rest = {k: v for k, v in schema.items() if k != "nullable"}
            return f"(?:{self.value(rest, refs)}|{self.literal(None)})"
        _unconstraining(schema)
        if "$ref" in schema:
            return self.reference(schema["$ref"], refs)
        if "const" in schema:
            return self.literal(schema["const"])
        if "enum" in schema:
            return "(?:" + "|".join(self.literal(v) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return "(?:" + "|".join(self.value(s, refs) for s in schema[key]) + ")"
        if "allOf" in schema:
            if len(schema["allOf"]) != 1:
                raise ValueError("json_schema allOf is supported with one schema only")
            return self.value(schema["allOf"][0], refs)
        kind = schema.get("type")
        if kind is None:
            implied = [("object", "properties"), ("object", "additionalProperties"),
                       ("array", "items"), ("array", "prefixItems"), ("number", "minimum"),
                       ("number", "maximum"), ("number", "exclusiveMinimum"),
                       ("number", "exclusiveMaximum")]  # fmt: skip
            kind = next((k for k, keyword in implied if keyword in schema), None)
        if kind is None:
            return self.free()
        if isinstance(kind, list):
            return "(?:" + "|".join(self.typed(schema, k, refs) for k in kind) + ")"
        return self.typed(schema, kind, refs)

    def reference(self, ref: str, refs: int) -> str:
        """A ``$ref`` within the schema: ``#`` (the whole schema), or a JSON pointer such as
        ``#/$defs/node`` or ``#/properties/a/items``; recursion is a rule of its own."""
        name = self.resolve(ref)
        if self.calls and name in self.open:  # recursion: the entry's own rule
            if name not in self.called:
                call, outer, self.open = self.rule(name), self.open, [name]
                self.rules[self.called[name] - 1] = self.value(self.defs[name], 0)
                self.open = outer
                return call
            return self.rule(name)
        if self.calls:
            self.open.append(name)
            try:
                return self.value(self.defs[name], 0)
            finally:
                self.open.pop()
        if refs >= MAX_REF_DEPTH:
            raise ValueError(
                f"json_schema $ref {ref!r} nests more than {MAX_REF_DEPTH} deep (recursion?)"
            )
        return self.value(self.defs[name], refs + 1)

    def resolve(self, ref: str) -> str:
        """The pointer ``ref`` names (RFC 6901: ``~1`` is ``/``, ``~0`` is ``~``), in
        :attr:`defs` under ``ref`` itself."""
        if ref not in self.defs:
            if not isinstance(ref, str) or not ref.startswith("#"):
                raise ValueError(f"json_schema $ref {ref!r}: only references within the schema "
                                 "(starting with #) are supported")  # fmt: skip
            node: Any = self.root
            for part in ref[1:].split("/")[1:] if ref != "#" else []:
                key = unquote(part).replace("~1", "/").replace("~0", "~")
                if isinstance(node, list) and key.isdigit() and int(key) < len(node):
                    node = node[int(key)]
                elif isinstance(node, dict) and key in node:
                    node = node[key]
                else:
                    raise ValueError(f"json_schema $ref {ref!r} names nothing in the schema")
            if ref[1:2] not in ("", "/") or not isinstance(node, (dict, bool)):
                raise ValueError(f"json_schema $ref {ref!r} does not name a schema")
            self.defs[ref] = node
        return ref

    def typed(self, schema: dict[str, Any], kind: str, refs: int) -> str:
        if kind == "string":
            return self.string(schema)
        if kind in ("integer", "number") and any(b in schema for b in BOUNDS):
            return number_range(schema, integer=kind == "integer")
        if kind in self.scalars:
            return self.scalars[kind]
        if kind == "array":
            return self.array(schema, refs)
        if kind == "object":
            extra = schema.get("additionalProperties")
            keyed = any(k in schema for k in ("properties", "propertyNames", "patternProperties"))
            if not keyed and extra in (None, True, {}):
                return self.free(top_object=True)
            return self.object(schema, refs)
        raise ValueError(f"json_schema type {kind!r} is not a JSON type")

    def string(self, schema: dict[str, Any]) -> str:
        """A string of ``minLength`` to ``maxLength`` characters, of the ``pattern`` or
        ``format`` if given (its strings that JSON writes as they are: no quote, backslash or
        control character, which the pattern would otherwise write unescaped)."""
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if schema.get("format") in PLAIN_FORMATS:
            schema = {k: v for k, v in schema.items() if k != "format"}
        if "pattern" not in schema and "format" not in schema:
            if low == 0 and high is None:
                return STRING
            return f'"{STRING_CHAR}{{{low},{"" if high is None else high}}}"'
        if "pattern" in schema:
            what = f"pattern {schema['pattern']!r}"
            tree = restrict(parse_regex(schema["pattern"]), PLAIN)  # no (?&n) call of a rule
        elif schema["format"] in FORMATS:
            what, tree = f"format {schema['format']!r}", format_tree(schema["format"], low, high)
        else:
            raise ValueError(f"json_schema string format {schema['format']!r} is not supported")
        if tree is None:
            raise ValueError(
                f"json_schema {what} matches only strings with a character JSON escapes (a "
                "quote, a backslash or a control character)"
            )
        if low != 0 or high is not None:
            tree = within(tree, low, high, what)
        return f'"{render(tree)}"'

    def array(self, schema: dict[str, Any], refs: int) -> str:
        """``items`` of one schema, or after ``prefixItems`` (a tuple: an item of each in turn,
        then ``items``' unless it is false), ``minItems`` to ``maxItems`` of them."""
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        prefix = [self.value(s, refs) for s in schema.get("prefixItems", [])]
        rest = schema.get("items", {})
        if not prefix:
            return _sequence(self.value(rest, refs), low, high, self.w)
        if rest is False:
            high = len(prefix) if high is None else min(high, len(prefix))
        if high is not None and high < low:
            raise ValueError(f"json_schema array allows no length: {low} to {high} items")
        w = self.w
        more = ""  # the items after the prefix's, as many as maxItems leaves
        if high is None or high > len(prefix):
            after = None if high is None else high - len(prefix)
            item = self.value(rest, refs)
            more = (
                f"(?:{w},{w}{item}){{{max(low - len(prefix), 0)},{'' if after is None else after}}}"
            )
        items = prefix[: len(prefix) if high is None else high]
        body = more
        for i in reversed(range(len(items))):  # item i, and then the rest only if it is there
            comma = f"{w},{w}" if i else ""
            body = f"{comma}{items[i]}{body}" if i < low else f"(?:{comma}{items[i]}{body})?"
        return rf"\[{w}{body}{w}\]"

    def object(self, schema: dict[str, Any], refs: int) -> str:
        """The properties in order, each required one present, optional ones where the model
        chooses, then others (:func:`~specdec.structured.json_strings.other_members`); commas
        only between the members present."""
        w, properties = self.w, schema.get("properties", {})
        required = set(schema.get("required", []))
        members = [
            (f"{self.literal(name)}{w}:{w}{self.value(sub, refs)}", name in required)
            for name, sub in properties.items()
        ]
        others = [
            f"{key}{w}:{w}{self.value(True if sub == {} else sub, refs)}"
            for key, sub in other_members(schema, list(properties), lambda s: self.value(s, refs))
        ]
        if others:
            other = f"(?:{'|'.join(others)})"
            members.append((f"{other}(?:{w},{w}{other})*", False))
        missing = required - set(properties)
        if missing:
            raise ValueError(f"json_schema requires {sorted(missing)[0]!r}, not in properties")
        return rf"\{{{w}(?:{members_regex(members, w)}){w}\}}"
