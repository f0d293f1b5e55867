"""The base of every request body: strict types, unknown fields ignored, text that is valid
Unicode."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """Refuse text that is not valid Unicode: JSON lets a lone UTF-16 surrogate (``"\\ud800"``)
        through, and neither the tokenizer nor a UTF-8 encoder can take one."""
        pending = [value]
        while pending:  # iterative: a value may be nested as deep as the JSON parser allowed
            item = pending.pop()
            if isinstance(item, str):
                _check_unicode(item)
            elif isinstance(item, list):
                pending.extend(item)
            elif isinstance(item, dict):
                pending.extend(item.keys())
                pending.extend(item.values())
        return value


def _check_unicode(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"contains a lone UTF-16 surrogate (U+{ord(text[e.start]):04X}) at character "
            f"{e.start}, which is not valid Unicode text"
        ) from None


def _not_zero(value: int | None) -> int | None:
    if value == 0:
        raise ValueError("must be -1 (as many as fit) or a positive number of tokens")
    return value


# vLLM's extra field: keep the prompt's last k tokens (-1: as many as leave room for one new one)
TruncatePromptTokens = Annotated[int | None, Field(ge=-1, lt=2**31), AfterValidator(_not_zero)]
