"""The request fields that give a guided request its guide (vLLM's ``guided_*`` and
``structured_outputs``, OpenAI's ``response_format``), checked one per request and turned into
the ``choice``, ``regex``, ``json_schema``, ``grammar`` or ``structural_tag`` of
:class:`~specdec.config.SamplingParams`."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import PrivateAttr, ValidationInfo, field_validator

from specdec.serving.strict import StrictModel
from specdec.structured.params import GUIDES, StructuredOutputsParams

# structured_outputs' kinds
STRUCTURED_KINDS = ("choice", "regex", "json", "grammar", "structural_tag", "json_object")
# structured_outputs' options of a JSON guide (see StructuredOutputsParams)
JSON_OPTIONS = (
    "whitespace_pattern", "disable_any_whitespace", "disable_additional_properties",
    "disable_fallback",
)  # fmt: skip


class GuidedFields(StrictModel):
    """The guide fields of completions and chat completions (at most one given)."""

    # extra (vLLM's): the output is one of these strings (guided_choice), matches a regular
    # expression (guided_regex), is JSON a schema accepts (guided_json) or a string a grammar
    # derives (guided_grammar: EBNF or Lark); or vLLM's newer structured_outputs: {"choice":
    # [...]}, {"regex": ...}, {"json": ...}, {"grammar": ...}, {"json_object": true},
    # {"structural_tag": ...} (its JSON text: free text with tagged structures)
    guided_choice: list[str] | None = None
    guided_regex: str | None = None
    guided_json: Any = None  # a JSON Schema: an object, or its text
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # extra (vLLM's): the whitespace allowed between JSON tokens (a regex; default: at most one
    # space), as structured_outputs' whitespace_pattern
    guided_whitespace_pattern: str | None = None
    # OpenAI's (chat; vLLM's completions too): {"type": "text"} (the default), {"type":
    # "json_object"} (any JSON object), {"type": "json_schema", "json_schema": {"name": ...,
    # "schema": {...}}}, or vLLM's {"type": "structural_tag", "format": {...}} (or "structures"
    # and "triggers": see specdec/structured/structural_tag.py)
    response_format: dict[str, Any] | None = None

    # the guide the server gives the request itself: strict tools under tool_choice "auto", see
    # routes.auto_tools (only where no field gives one)
    _tool_guide: dict[str, Any] | None = PrivateAttr(None)

    GUIDED: ClassVar[tuple[str, ...]] = (
        "guided_choice", "guided_regex", "guided_json", "guided_grammar"
    )  # fmt: skip

    @field_validator("structured_outputs")
    @classmethod
    def _known_kinds(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        kinds = structured_kinds(value)
        for key in kinds:
            if key not in STRUCTURED_KINDS:
                raise ValueError(
                    f"{key} is not supported by this server; use one of "
                    f"{', '.join(STRUCTURED_KINDS)}"
                )
        if len(kinds) > 1:
            raise ValueError(f"give one kind, not {', '.join(kinds)}")
        _check_choice(kinds.get("choice"), "choice ")
        for kind in ("regex", "grammar"):
            if kind in kinds and not isinstance(kinds[kind], str):
                raise ValueError(f"{kind} must be a string")
        if "structural_tag" in kinds and not isinstance(kinds["structural_tag"], (dict, str)):
            raise ValueError("structural_tag must be its JSON text (or an object)")
        if "json" in kinds and not isinstance(kinds["json"], (dict, str)):
            raise ValueError("json must be a JSON Schema (an object, or its text)")
        if "json_object" in kinds and kinds["json_object"] is not True:
            raise ValueError("json_object must be true or false")
        for key in JSON_OPTIONS[1:]:
            if not isinstance((value or {}).get(key, False), bool):
                raise ValueError(f"{key} must be true or false")
        if not isinstance((value or {}).get("whitespace_pattern") or "", str):
            raise ValueError("whitespace_pattern must be a string")
        return value

    @field_validator("guided_json")
    @classmethod
    def _schema(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, (dict, str)):
            raise ValueError("must be a JSON Schema (an object, or its text)")
        return value

    @field_validator("guided_choice")
    @classmethod
    def _choice_strings(cls, value: list[str] | None) -> list[str] | None:
        _check_choice(value, "")
        return value

    @field_validator("guided_regex", "guided_json", "guided_grammar", "structured_outputs")
    @classmethod
    def _one_guide(cls, value: Any, info: ValidationInfo) -> Any:
        given = guides_given(info.data)  # the fields before this one
        if (
            given
            and value is not None
            and (info.field_name != "structured_outputs" or structured_kinds(value))
        ):
            raise ValueError(f"give one of {given[0]} and {info.field_name}, not both")
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: dict[str, Any] | None, info: ValidationInfo) -> Any:
        kind = (value or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema", "structural_tag"):
            raise ValueError(
                f"type must be text, json_object, json_schema or structural_tag, got {kind!r}"
            )
        if kind == "json_schema":
            spec = value.get("json_schema") if value else None
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError('json_schema needs {"name": ..., "schema": {...}}')
        given = guides_given(info.data)
        if kind != "text" and given:
            raise ValueError(f"give one of {given[0]} and response_format, not both")
        return value

    def guide(self) -> dict[str, Any]:
        """The guide as SamplingParams takes it: ``{"choice" | "regex" | "json_schema" |
        "grammar" | "structural_tag": ...}`` or nothing, from whichever field gave it
        (validated: one at most)."""
        if self._tool_guide is not None:
            return self._tool_guide
        kind = (self.response_format or {}).get("type", "text")
        if kind == "structural_tag":
            return {"structural_tag": self.response_format}
        if kind != "text":
            spec = (self.response_format or {}).get("json_schema") or {}
            return self._with_json_options(format_guide(kind, spec.get("schema", {})))
        structured = {k: v for k, v in (self.structured_outputs or {}).items() if v is not None}
        return self._with_json_options(self._guide_of(structured))

    def _guide_of(self, structured: dict[str, Any]) -> dict[str, Any]:
        for field, kind, key in (
            ("guided_choice", "choice", "choice"),
            ("guided_regex", "regex", "regex"),
            ("guided_json", "json", "json_schema"),
            ("guided_grammar", "grammar", "grammar"),
            (None, "structural_tag", "structural_tag"),
        ):
            if field is not None and getattr(self, field) is not None:
                return {key: getattr(self, field)}
            if kind in structured:
                return {key: structured[kind]}
        if structured.get("json_object"):
            return {"json_schema": {"type": "object"}}
        return {}

    def _with_json_options(self, guide: dict[str, Any]) -> dict[str, Any]:
        """A JSON guide with structured_outputs' whitespace options (or guided_whitespace_pattern)
        as its regex (:meth:`StructuredOutputsParams.guide`)."""
        options = {k: v for k, v in (self.structured_outputs or {}).items() if k in JSON_OPTIONS}
        if self.guided_whitespace_pattern is not None:
            options["whitespace_pattern"] = self.guided_whitespace_pattern
        ws = options.get("whitespace_pattern") is not None or options.get("disable_any_whitespace")
        if not ws or not guide:  # no option to apply, or no guide to apply it to
            return guide
        if "json_schema" not in guide:
            raise ValueError(
                "structured_outputs: whitespace_pattern and disable_any_whitespace apply to a "
                "JSON guide only"
            )
        return StructuredOutputsParams(json=guide["json_schema"], **options).guide()

    def guided(self) -> bool:
        """Whether any field (or the server: :meth:`guide_tools`) gives this request a guide."""
        return bool(guides_given(self.__dict__)) or self._tool_guide is not None

    def guide_tools(self, guide: dict[str, Any] | None) -> None:
        """Guide a request whose fields give no guide by ``guide``, the tools' own."""
        self._tool_guide = guide

    def param_of(self, name: str) -> str:
        """The request field to name in an error about SamplingParams' field ``name``: the
        field that gave the guide for the guide fields (:data:`GUIDES`)."""
        name = name.rstrip(":")  # "structural_tag.format...": the field is structural_tag
        guide = name.split(".")[0] in (*GUIDES, "structured_outputs")
        return self.guide_field() if guide else name

    def guide_field(self) -> str:
        if self._tool_guide is not None:
            return "tools"
        if (self.response_format or {}).get("type", "text") != "text":
            return "response_format"
        given = [n for n in self.GUIDED if getattr(self, n) is not None]
        return given[0] if given else "structured_outputs"


def format_guide(kind: str, schema: dict[str, Any] | None) -> dict[str, Any]:
    """The guide of one of OpenAI's reply formats: "json_object" (any JSON object) or
    "json_schema" (the documents ``schema`` accepts); "text" has none."""
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    return {"json_schema": schema} if kind == "json_schema" else {}


def guides_given(fields: dict[str, Any]) -> list[str]:
    """The fields among a request's ``fields`` (those validated so far) that give a guide."""
    names = [n for n in GuidedFields.GUIDED if fields.get(n) is not None]
    if structured_kinds(fields.get("structured_outputs")):
        names.append("structured_outputs")
    if (fields.get("response_format") or {}).get("type", "text") != "text":
        names.append("response_format")
    return names


def structured_kinds(structured: dict[str, Any] | None) -> dict[str, Any]:
    """The guide kinds ``structured_outputs`` gives (set, and not an option of a JSON guide)."""
    return {
        k: v
        for k, v in (structured or {}).items()
        if v is not None and v is not False and k not in JSON_OPTIONS
    }


def _check_choice(choice: Any, name: str) -> None:
    if choice is not None and not (
        isinstance(choice, list) and choice and all(isinstance(c, str) and c for c in choice)
    ):
        raise ValueError(f"{name}must be a non-empty list of non-empty strings")
