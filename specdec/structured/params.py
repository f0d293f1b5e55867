"""vLLM's ``StructuredOutputsParams``: the structured-output request that
:class:`specdec.config.SamplingParams` takes as ``structured_outputs``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``, for code written against it: one of ``json`` (a JSON
    Schema), ``regex``, ``choice`` or ``json_object=True`` (any JSON object), which
    ``SamplingParams(structured_outputs=...)`` takes as its ``json_schema``, ``regex`` or
    ``choice``. ``grammar`` is refused."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None

    def guide(self) -> dict[str, Any]:
        """The SamplingParams fields this sets (ValueError unless exactly one kind is given)."""
        if self.grammar is not None:
            raise ValueError(
                "structured_outputs.grammar is not supported: give json, regex, choice or "
                "json_object"
            )
        given = {
            key: value
            for key, value in (
                ("json_schema", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("json_schema", {"type": "object"} if self.json_object else None),
            )
            if value is not None
        }
        kinds = [k for k in ("json", "regex", "choice") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one kind, got {kinds or 'none'}")
        return given
