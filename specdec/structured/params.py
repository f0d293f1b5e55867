"""vLLM's ``StructuredOutputsParams``: the structured-output request that
:class:`specdec.config.SamplingParams` takes as ``structured_outputs``; and the checks of
``SamplingParams``' guide fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.structured.automaton import ending
from specdec.structured.grammar import grammar_rules
from specdec.structured.json_schema import schema_regex, schema_rules
from specdec.structured.regex import parse_regex
from specdec.structured.structural_tag import structural_tag_rules

# SamplingParams' guide fields
GUIDES = ("choice", "regex", "json_schema", "grammar", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``, for code written against it: one of ``json`` (a JSON
    Schema), ``regex``, ``choice``, ``grammar``, ``structural_tag`` (its JSON text) or
    ``json_object=True`` (any JSON object), which ``SamplingParams(structured_outputs=...)``
    takes as its ``json_schema``, ``regex``, ``choice``, ``grammar`` or ``structural_tag``.

    For JSON: ``whitespace_pattern`` (a regex) replaces the whitespace allowed between JSON
    tokens (at most one space by default), ``disable_any_whitespace=True`` allows none; the
    guide is then the schema's regex with it (``SamplingParams.regex``).
    ``disable_additional_properties`` changes nothing: an object takes properties its schema
    does not list only where its ``additionalProperties`` says so (true or a schema), never by
    default (what the flag asks of vLLM's guidance backend). ``disable_fallback`` has no
    meaning here (one guide, no fallback)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False

    def guide(self) -> dict[str, Any]:
        """The SamplingParams fields this sets (ValueError unless exactly one kind is given)."""
        schema = {"type": "object"} if self.json_object else self.json
        given = {
            key: value
            for key, value in (
                ("json_schema", schema),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("structural_tag", self.structural_tag),
            )
            if value is not None
        }
        names = ("json", "regex", "choice", "grammar", "structural_tag")
        kinds = [k for k in names if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one kind, got {kinds or 'none'}")
        whitespace = "" if self.disable_any_whitespace else self.whitespace_pattern
        if whitespace is not None and schema is None:
            raise ValueError(
                "structured_outputs: whitespace_pattern and disable_any_whitespace apply to json "
                "and json_object only"
            )
        if whitespace is not None and schema is not None:
            if whitespace:
                parse_regex(whitespace)
            return {"regex": schema_regex(schema, whitespace)}
        return given


@dataclass(slots=True)
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's name of :class:`StructuredOutputsParams` before v0.11, which
    ``SamplingParams(guided_decoding=...)`` takes. ``backend`` names the library vLLM would
    follow the guide with (xgrammar, outlines, ...); this engine has its own, so it is
    ignored."""

    backend: str | None = None


def check_guides(params: Any) -> None:  # noqa: ANN401 - a SamplingParams (which imports this)
    """Validate a ``SamplingParams``' guide fields (:data:`GUIDES`, ``guide_after``,
    ``guide_after_opening``); ValueError naming the field. A pattern's syntax is checked now, its DFA
    built when the request is added."""
    choice, regex, schema, after = (
        params.choice,
        params.regex,
        params.json_schema,
        params.guide_after,
    )
    _require(
        choice is None
        or (isinstance(choice, list) and choice and all(isinstance(c, str) and c for c in choice)),
        f"choice must be a non-empty list of non-empty strings, got {choice!r}",
    )
    _require(
        regex is None or (isinstance(regex, str) and regex != ""),
        f"regex must be a non-empty string, got {regex!r}",
    )
    _require(
        schema is None or isinstance(schema, (dict, str)),
        f"json_schema must be a dict or its JSON text, got {type(schema).__name__}",
    )
    if regex is not None:
        parse_regex(regex)
    if schema is not None:
        trees = [parse_regex(rule, calls=True) for rule in schema_rules(schema)]  # the guide's
        _require(0 in ending(trees), "json_schema matches no document: each way through it "
                 "refers to itself before anything else (a $ref to itself, say)")  # fmt: skip
    if params.grammar is not None:
        _require(
            isinstance(params.grammar, str) and params.grammar.strip(),
            f"grammar must be a non-empty string, got {params.grammar!r}",
        )
        for rule in grammar_rules(params.grammar):  # the guide's patterns
            parse_regex(rule, calls=True)
    if params.structural_tag is not None:
        _require(
            isinstance(params.structural_tag, (str, dict)),
            f"structural_tag must be its JSON text or an object, got {params.structural_tag!r}",
        )
        _require(0 in ending(structural_tag_rules(params.structural_tag)),
                 "structural_tag matches no string: a schema in it refers to itself before "
                 "anything else")  # fmt: skip
    guides = [n for n in GUIDES if getattr(params, n) is not None]
    _require(len(guides) <= 1, f"give one of {', '.join(GUIDES)}, not {guides}")
    _require(
        not guides or not (params.ignore_eos or params.min_tokens),
        f"{guides[0] if guides else ''} ends the output where it is complete: leave "
        f"ignore_eos and min_tokens unset",
    )
    opening = params.guide_after_opening
    _require(
        opening is None or (isinstance(opening, str) and opening != "" and after is not None),
        f"guide_after_opening must be a non-empty string, with guide_after; got {opening!r}",
    )
    _require(
        after is None or (isinstance(after, str) and after != "" and bool(guides)),
        f"guide_after must be a non-empty string, with a guide ({', '.join(GUIDES)}) to apply "
        f"after it; got {after!r}" + ("" if guides else " and no guide"),
    )


def _require(ok: Any, message: str) -> None:  # noqa: ANN401
    if not ok:
        raise ValueError(message)
