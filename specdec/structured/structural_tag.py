"""Structural tags: free text with tagged structures in it (vLLM's ``structural_tag``, after
XGrammar's format), for tool calls a model writes among its prose.

Two spellings are read. vLLM's first one::

    {"type": "structural_tag", "triggers": ["<function="],
     "structures": [{"begin": "<function=f>", "schema": {...}, "end": "</function>"}]}

lets the output be any text until a trigger appears; from there it must be one of the structures
whose ``begin`` starts with that trigger, JSON its schema accepts, then its ``end``; then free
text again. XGrammar's newer one, ``{"type": "structural_tag", "format": {...}}``, composes
formats: ``const_string`` (``value``), ``json_schema`` (``json_schema``), ``regex``
(``pattern``), ``grammar`` (``grammar``, EBNF or Lark), ``any_text`` (``excluded_str``: strings it
never holds), ``sequence`` and ``or`` (``elements``), ``tag`` (``begin``, ``content``, ``end``; an
``any_text`` content never holds the end), ``triggered_tags`` (``triggers``, ``tags``,
``at_least_one``: a tag comes first, ``stop_after_first``: one tag at most) and
``tags_with_separator`` (``tags``, ``separator``, ``at_least_one``, ``stop_after_first``: tags
and separators only). The first spelling is ``triggered_tags`` with ``json_schema`` contents.

A format becomes a syntax tree for :func:`~specdec.structured.automaton.compile_tree`: the parts
that are patterns are parsed as patterns, and text that must not hold some strings (free text
before a trigger, an ``any_text``) is the tree node ``("avoid", strings)``, an Aho-Corasick
automaton. The result is one byte DFA, or, where a schema or grammar in it nests (free-form
JSON, recursive rules), the first of the trees of a pushdown guide
(:mod:`specdec.structured.pushdown`); either is indexed and verified against as every guide is,
so drafts and exactness are every guide's. Free text before a tag holds no trigger: the first trigger
opens a tag. ``qwen_xml_parameter`` is refused.
"""

from __future__ import annotations

import json
from typing import Any

from specdec.structured.grammar import grammar_rules
from specdec.structured.json_schema import schema_rules
from specdec.structured.regex import parse_regex

MAX_WORDS = 10_000  # bytes of triggers, ends and excluded strings (their automaton's states)
FORMATS = (
    "const_string", "json_schema", "regex", "grammar", "any_text", "sequence", "or", "tag",
    "triggered_tags", "tags_with_separator",
)  # fmt: skip


def read_structural_tag(spec: str | dict[str, Any]) -> dict[str, Any]:
    """The format a structural tag (its JSON text or the object) describes, XGrammar's way (the
    first spelling rewritten as ``triggered_tags``); ValueError naming what is wrong."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"structural_tag: not JSON: {e}") from None
    _require(isinstance(spec, dict), "structural_tag", "must be an object")
    assert isinstance(spec, dict)
    _require(
        spec.get("type", "structural_tag") == "structural_tag",
        "structural_tag.type",
        f"must be 'structural_tag', got {spec.get('type')!r}",
    )
    if "format" in spec:
        _require("structures" not in spec, "structural_tag", "give format or structures, not both")
        return spec["format"]
    _require(
        "structures" in spec and "triggers" in spec,
        "structural_tag",
        'needs "format", or "structures" and "triggers"',
    )
    structures = spec["structures"]
    _require(isinstance(structures, list) and structures, "structural_tag.structures", _NONEMPTY)
    tags = []
    for i, s in enumerate(structures):
        where = f"structural_tag.structures[{i}]"
        _require(isinstance(s, dict), where, 'must be {"begin": ..., "schema": ..., "end": ...}')
        _keys(s, where, ("begin", "schema", "end"), ("begin", "schema", "end"))
        content = {"type": "json_schema", "json_schema": s["schema"]}
        tags.append({"begin": s["begin"], "content": content, "end": s["end"]})
    return {"type": "triggered_tags", "triggers": spec["triggers"], "tags": tags}


def structural_tag_rules(spec: str | dict[str, Any]) -> list[tuple]:
    """A structural tag's syntax trees: the whole output's first, then the rules its schemas
    and grammars call (free-form JSON, recursive rules: any depth), for the pushdown guide; one
    tree where there are none. ValueError naming the place of what is wrong (in the first
    spelling's own names where it was given so)."""
    builder, f = _Builder(), read_structural_tag(spec)
    try:
        tree = builder.format(f, "structural_tag.format")
    except ValueError as e:
        if "structures" not in (json.loads(spec) if isinstance(spec, str) else spec):
            raise
        where = str(e).replace("format.tags[", "structures[").replace(".content.json_", ".")
        raise type(e)(where.replace("structural_tag.format.", "structural_tag.")) from None
    return [tree, *builder.rules]


class _Builder:
    def __init__(self) -> None:
        self.words, self.rules = 0, list[tuple]()  # rules' trees (rule n is rules[n - 1])

    def _rules(self, patterns: Any, where: str) -> tuple:  # noqa: ANN401 - () -> tuple[str]
        """The first of the patterns ``patterns()`` gives, as a tree, the others kept as rules,
        their calls numbered after the rules kept before."""
        try:
            trees = [parse_regex(p, calls=True) for p in patterns()]
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        offset = len(self.rules)
        trees = [_renumber(t, offset) for t in trees]
        self.rules += trees[1:]
        return trees[0]

    def format(self, f: Any, where: str) -> tuple:  # noqa: ANN401
        _require(isinstance(f, dict) and "type" in f, where, 'must be an object with a "type"')
        kind = f["type"]
        _require(
            kind in FORMATS,
            f"{where}.type",
            f"{kind!r} is not supported; use one of {', '.join(FORMATS)}",
        )
        return getattr(self, "or_" if kind == "or" else kind)(f, where)

    def const_string(self, f: dict[str, Any], where: str) -> tuple:
        _keys(f, where, ("value",), ("value",))
        return _text(_string(f["value"], f"{where}.value", empty=True))

    def json_schema(self, f: dict[str, Any], where: str) -> tuple:
        _keys(f, where, ("json_schema",), ("json_schema", "style"))
        style = f.get("style", "json")
        _require(style == "json", f"{where}.style", f"only 'json' is supported, got {style!r}")
        schema = f["json_schema"]
        _require(isinstance(schema, (dict, str, bool)), f"{where}.json_schema", "not a schema")
        return self._rules(lambda: schema_rules(schema), f"{where}.json_schema")

    def regex(self, f: dict[str, Any], where: str) -> tuple:
        _keys(f, where, ("pattern",), ("pattern",))
        pattern = _string(f["pattern"], f"{where}.pattern")
        return _parsed(lambda: pattern, f"{where}.pattern")

    def grammar(self, f: dict[str, Any], where: str) -> tuple:
        _keys(f, where, ("grammar",), ("grammar",))
        text = _string(f["grammar"], f"{where}.grammar")
        return self._rules(lambda: grammar_rules(text), f"{where}.grammar")

    def any_text(self, f: dict[str, Any], where: str, end: str = "") -> tuple:
        _keys(f, where, (), ("excluded_str",))
        excluded = f.get("excluded_str", [])
        _require(isinstance(excluded, list), f"{where}.excluded_str", "must be a list of strings")
        words = [_string(w, f"{where}.excluded_str[{i}]") for i, w in enumerate(excluded)]
        return self.avoid([*words, end] if end else words, where)

    def avoid(self, words: list[str], where: str) -> tuple:
        spelled = tuple(dict.fromkeys(w.encode() for w in words))
        self.words += sum(map(len, spelled))
        _require(
            self.words <= MAX_WORDS,
            where,
            f"triggers, ends and excluded strings pass {MAX_WORDS} bytes",
        )
        return ("avoid", spelled)

    def sequence(self, f: dict[str, Any], where: str) -> tuple:
        return ("cat", self._elements(f, where))

    def or_(self, f: dict[str, Any], where: str) -> tuple:
        return ("alt", self._elements(f, where))

    def _elements(self, f: dict[str, Any], where: str) -> list[tuple]:
        _keys(f, where, ("elements",), ("elements",))
        elements = f["elements"]
        _require(isinstance(elements, list) and elements, f"{where}.elements", _NONEMPTY)
        return [self.format(e, f"{where}.elements[{i}]") for i, e in enumerate(elements)]

    def tag(self, f: dict[str, Any], where: str) -> tuple:
        _keys(f, where, ("begin", "content", "end"), ("begin", "content", "end"))
        begin = _string(f["begin"], f"{where}.begin", empty=True)
        end = _string(f["end"], f"{where}.end", empty=True)
        content, inner = f["content"], f"{where}.content"
        if isinstance(content, dict) and content.get("type") == "any_text":
            body = self.any_text(content, inner, end)  # the text never holds the end
        else:
            body = self.format(content, inner)
        return ("cat", [_text(begin), body, _text(end)])

    def _tags(self, f: dict[str, Any], where: str) -> tuple:
        tags = f["tags"]
        _require(isinstance(tags, list) and tags, f"{where}.tags", _NONEMPTY)
        options = []
        for i, t in enumerate(tags):
            _require(
                isinstance(t, dict) and t.get("type", "tag") == "tag",
                f"{where}.tags[{i}]",
                'must be a tag object ({"begin": ..., "content": ..., "end": ...})',
            )
            options.append(self.tag({**t, "type": "tag"}, f"{where}.tags[{i}]"))
        return ("alt", options)

    def triggered_tags(self, f: dict[str, Any], where: str) -> tuple:
        _keys(f, where, ("triggers", "tags"), ("triggers", "tags", *_COUNTS))
        triggers = f["triggers"]
        _require(isinstance(triggers, list) and triggers, f"{where}.triggers", _NONEMPTY)
        triggers = [_string(t, f"{where}.triggers[{i}]") for i, t in enumerate(triggers)]
        tags, free = self._tags(f, where), self.avoid(triggers, where)
        for i, t in enumerate(f["tags"]):
            opening = [x for x in triggers if t["begin"].startswith(x)]
            _require(
                len(opening) == 1,
                f"{where}.tags[{i}].begin",
                f"must start with exactly one trigger; {t['begin']!r} starts with "
                f"{opening or 'none'}",
            )
        first, one = _counts(f, where)
        if one:
            return tags if first else ("cat", [free, ("rep", tags, 0, 1)])
        more = ("rep", ("cat", [free, tags]), 0, None)
        return ("cat", [tags, more, free] if first else [more, free])

    def tags_with_separator(self, f: dict[str, Any], where: str) -> tuple:
        keys = ("tags", "separator")
        _keys(f, where, keys, (*keys, *_COUNTS))
        tags = self._tags(f, where)
        separator = _text(_string(f["separator"], f"{where}.separator", empty=True))
        first, one = _counts(f, where)
        some = tags if one else ("cat", [tags, ("rep", ("cat", [separator, tags]), 0, None)])
        return some if first else ("rep", some, 0, 1)


_NONEMPTY = "must be a non-empty list"
_COUNTS = ("at_least_one", "stop_after_first")


def _counts(f: dict[str, Any], where: str) -> tuple[bool, bool]:
    values = [f.get(key, False) for key in _COUNTS]
    for key, value in zip(_COUNTS, values):
        _require(isinstance(value, bool), f"{where}.{key}", "must be true or false")
    return values[0], values[1]


def _text(text: str) -> tuple:
    """A literal: its characters, each a one-character set."""
    return ("cat", [("set", [(ord(c), ord(c))]) for c in text])


def _renumber(tree: tuple, offset: int) -> tuple:
    """``tree`` with each call of rule n a call of rule n + ``offset``."""
    kind = tree[0]
    if kind == "call":
        return ("call", tree[1] + offset)
    if kind in ("cat", "alt"):
        return (kind, [_renumber(t, offset) for t in tree[1]])
    if kind == "rep":
        return ("rep", _renumber(tree[1], offset), *tree[2:])
    return tree


def _parsed(pattern: Any, where: str) -> tuple:  # noqa: ANN401 - () -> str
    """The syntax tree of the pattern ``pattern()`` gives; its ValueError names ``where``."""
    try:
        return parse_regex(pattern())
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _string(value: Any, where: str, empty: bool = False) -> str:  # noqa: ANN401
    _require(
        isinstance(value, str) and (empty or value),
        where,
        f"must be a {'' if empty else 'non-empty '}string, got {value!r}",
    )
    return value


def _keys(f: dict[str, Any], where: str, needed: tuple[str, ...], known: tuple[str, ...]) -> None:
    missing = [k for k in needed if k not in f]
    _require(not missing, where, f"needs {', '.join(missing)}")
    unknown = [k for k in f if k not in (*known, "type")]
    _require(not unknown, where, f"unknown field {', '.join(unknown)}")


def _require(ok: Any, where: str, message: str) -> None:  # noqa: ANN401
    if not ok:
        raise ValueError(f"{where}: {message}")
