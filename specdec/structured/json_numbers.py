"""JSON numbers within bounds as regular expressions: a schema's ``minimum``, ``maximum``,
``exclusiveMinimum`` and ``exclusiveMaximum`` (pydantic's ``ge``, ``le``, ``gt``, ``lt``).

A number is read as its digits, so a bound is a comparison of digit strings: an integer part of
as many digits as the bound's compares digit by digit, a longer one is larger; a fraction
compares digit by digit as written, shorter ones padded with zeros. Each pattern below follows
that comparison one digit at a time, as the classic construction of a regex for an integer range
does (split at the first digit where the string leaves the bound), here extended to fractions.
Every string a pattern matches is a number within its bounds; bounded numbers are written
without an exponent (``1e3`` is refused where ``1000`` is allowed), and integers without a
leading zero or ``-0``.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

Bound = tuple[str, bool] | None  # a fraction's digits and whether the bound is strict


def number_range(schema: dict[str, Any], integer: bool) -> str:
    """The pattern of the integers (``integer``) or numbers ``schema``'s bounds allow."""
    low, low_strict = _bound(schema, "minimum", "exclusiveMinimum")
    high, high_strict = _bound(schema, "maximum", "exclusiveMaximum")
    if integer:  # integer bounds, inclusive
        if low is not None:
            low = low.to_integral_value("ROUND_FLOOR") + 1 if low_strict else _ceil(low)
        if high is not None:
            high = _ceil(high) - 1 if high_strict else high.to_integral_value("ROUND_FLOOR")
        low_strict = high_strict = False
    if (
        low is not None
        and high is not None
        and (low > high or (low == high and (low_strict or high_strict)))
    ):
        raise ValueError(f"json_schema allows no number between {low} and {high}")
    parts = []
    if high is None or high > 0 or (high == 0 and not high_strict):  # zero and above
        start = max(low, Decimal(0)) if low is not None else Decimal(0)
        strict = low_strict and low is not None and low >= 0
        parts.append(_unsigned(start, strict, high, high_strict, integer))
    if low is None or low < 0:  # below zero: minus a number above zero
        top = -high if high is not None and high < 0 else Decimal(0)
        strict = high_strict if high is not None and high < 0 else True
        bottom = None if low is None else -low
        parts.append("-" + _unsigned(top, strict, bottom, low_strict, integer))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _bound(schema: dict[str, Any], inclusive: str, exclusive: str) -> tuple[Decimal | None, bool]:
    """A bound and whether it is strict (JSON Schema's number form of ``exclusiveMinimum``, or
    draft 4's ``true`` beside ``minimum``); of two, the tighter."""
    value = None if schema.get(inclusive) is None else _decimal(schema[inclusive], inclusive)
    other = schema.get(exclusive)
    if isinstance(other, bool):
        return value, other and value is not None
    if other is None:
        return value, False
    strict = _decimal(other, exclusive)
    if value is None:
        return strict, True
    looser = strict < value if inclusive == "minimum" else strict > value
    return (value, False) if looser else (strict, True)


def _decimal(value: Any, name: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"json_schema {name} must be a number, got {value!r}")
    try:
        number = Decimal(repr(value) if isinstance(value, float) else value)
    except InvalidOperation:
        number = Decimal("nan")
    if not number.is_finite():
        raise ValueError(f"json_schema {name} must be a finite number, got {value!r}")
    return number


def _ceil(value: Decimal) -> Decimal:
    return value.to_integral_value("ROUND_CEILING")


def _unsigned(
    low: Decimal, low_strict: bool, high: Decimal | None, high_strict: bool, integer: bool
) -> str:
    """Numbers written without a sign between ``low`` >= 0 and ``high`` (None: no bound)."""
    if integer:
        pattern = _naturals(
            int(low) + low_strict, None if high is None else int(high) - high_strict
        )
        if not pattern:
            raise ValueError(f"json_schema allows no integer between {low} and {high}")
        return pattern
    whole_low = int(low)
    whole_high = None if high is None else int(high)
    parts = []
    for whole in sorted({whole_low, whole_high} - {None}):  # type: ignore[type-var]
        lower: Bound = (_digits(low), low_strict) if whole == whole_low else None
        upper: Bound = (_digits(high), high_strict) if whole == whole_high else None
        bare, fractions = _fractions(lower, upper)
        if fractions is None and not bare:
            continue
        tail = "" if fractions is None else rf"\.(?:{fractions})"
        parts.append(f"{whole}(?:{tail})?" if bare and tail else f"{whole}{tail}")
    between = _naturals(whole_low + 1, None if whole_high is None else whole_high - 1)
    if between:
        parts.append(rf"{between}(?:\.[0-9]+)?")
    if not parts:
        raise ValueError(f"json_schema allows no number between {low} and {high}")
    return "(?:" + "|".join(parts) + ")"


def _digits(value: Decimal | None) -> str:
    """The digits of ``value``'s fraction, trailing zeros dropped."""
    assert value is not None
    text = format(value, "f")
    return text.partition(".")[2].rstrip("0")


def _fractions(low: Bound, high: Bound) -> tuple[bool, str | None]:
    """Digit strings ``s`` with ``0.s`` within the bounds: whether the empty one is (a number
    with no fraction), and a pattern of the others (None: there are none)."""
    if low is not None and not low[0] and not low[1]:
        low = None  # >= 0: every fraction
    if high is not None and not high[0]:
        if high[1]:
            return False, None  # < 0
        return low is None, ("0+" if low is None else None)  # <= 0: zeros, unless > 0
    if low is None and high is None:
        return True, "[0-9]+"
    if high is None and low is not None and not low[0]:  # > 0: a digit other than zero
        return False, "0*[1-9][0-9]*"
    bare = low is None  # the empty string is 0: above every lower bound but 0 itself
    groups: list[tuple[list[str], str]] = []
    for c in "0123456789":  # the first digit, and the bounds on the rest where it ties
        rest_low = rest_high = None
        if low is not None:
            first, rest = low[0][:1] or "0", (low[0][1:], low[1])
            if c < first:
                continue
            rest_low = rest if c == first else None
        if high is not None:
            first, rest = high[0][:1], (high[0][1:], high[1])
            if c > first:
                continue
            rest_high = rest if c == first else None
        empty, more = _fractions(rest_low, rest_high)
        if more is None and not empty:
            continue
        tail = "" if more is None else (f"(?:{more})?" if empty else f"(?:{more})")
        if groups and groups[-1][1] == tail:
            groups[-1][0].append(c)
        else:
            groups.append(([c], tail))
    if not groups:
        return bare, None
    alternatives = [_digit_class(digits) + tail for digits, tail in groups]
    return bare, "|".join(alternatives)


def _digit_class(digits: list[str]) -> str:
    return digits[0] if len(digits) == 1 else f"[{digits[0]}-{digits[-1]}]"


def _naturals(low: int, high: int | None) -> str:
    """Integers from ``low`` >= 0 to ``high`` (None: no bound), without leading zeros ("": none)."""
    if high is not None and high < low:
        return ""
    short, long = len(str(low)), None if high is None else len(str(high))
    if short == long:
        return _same_width(str(low), str(high))
    parts = [_same_width(str(low), "9" * short)]  # as wide as low, then every width between
    if long is None:
        parts.append(f"[1-9][0-9]{{{short},}}")
    else:
        if long - short > 1:
            parts.append(f"[1-9][0-9]{{{short},{long - 2}}}")
        parts.append(_same_width("1" + "0" * (long - 1), str(high)))  # as wide as high
    return "(?:" + "|".join(parts) + ")"


def _same_width(low: str, high: str) -> str:
    """Digit strings of one width from ``low`` to ``high``."""
    if low == high:
        return low
    if set(low) == {"0"} and set(high) == {"9"}:  # every string of the width
        return f"[0-9]{{{len(low)}}}"
    if len(low) == 1:
        return _digit_class([low, high])
    head_low, head_high = low[0], high[0]
    rest = len(low) - 1
    if head_low == head_high:
        return head_low + _same_width(low[1:], high[1:])
    parts = [head_low + _same_width(low[1:], "9" * rest)]
    if int(head_high) - int(head_low) > 1:
        parts.append(
            _digit_class([str(int(head_low) + 1), str(int(head_high) - 1)]) + f"[0-9]{{{rest}}}"
        )
    parts.append(head_high + _same_width("0" * rest, high[1:]))
    return "(?:" + "|".join(parts) + ")"
