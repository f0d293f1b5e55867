"""Strings in a JSON Schema's patterns: a pattern or format cut to ``minLength`` and
``maxLength``, and object keys other than the listed properties."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from specdec.structured.regex import parse_regex

KEY_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\bfnrt])'  # a character with one spelling only
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
STRING = f'"{STRING_CHAR}*"'
FORMATS = {
    "date": r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])",
    "time": r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-][0-9]{2}:[0-9]{2})?",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}
FORMATS["date-time"] = FORMATS["date"] + "T" + FORMATS["time"]
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # a host name's, RFC 1123
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_ATOM = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"  # an e-mail's local part: RFC 5322's dot-atom
FORMATS["hostname"] = rf"{_LABEL}(?:\.{_LABEL})*"
FORMATS["ipv4"] = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
FORMATS["email"] = rf"{_ATOM}(?:\.{_ATOM})*@{_LABEL}(?:\.{_LABEL})+"
_N, _H = "[0-9]+", "[0-9A-Fa-f]{1,4}"  # a duration's number, an IPv6 address's group
_SECONDS = rf"{_N}(?:\.[0-9]+)?S"
# ISO 8601 durations (pydantic's timedelta): at least one part, a time's after "T"
_DATE = rf"(?:{_N}Y(?:{_N}M)?(?:{_N}W)?(?:{_N}D)?|{_N}M(?:{_N}W)?(?:{_N}D)?|{_N}W(?:{_N}D)?|{_N}D)"
_TIME = rf"T(?:{_N}H(?:{_N}M)?(?:{_SECONDS})?|{_N}M(?:{_SECONDS})?|{_SECONDS})"
FORMATS["duration"] = rf"-?P(?:{_DATE}(?:{_TIME})?|{_TIME})"


def _groups(n: int, exactly: bool = False) -> str:
    """``n`` IPv6 groups joined by colons (or, not ``exactly``, none to ``n``)."""
    if n == 0:
        return ""
    if exactly:
        return f"{_H}(?::{_H}){{{n - 1}}}"
    return f"(?:{_H}(?::{_H}){{0,{n - 1}}})?"


def _ipv6() -> str:
    """RFC 4291 2.2's text forms: eight groups, or six and an IPv4 address, where one "::"
    stands for one or more groups of zeros (an alternative per count of groups before it)."""
    forms = [_groups(8, True), f"{_groups(6, True)}:{FORMATS['ipv4']}"]
    for before in range(8):
        forms.append(f"{_groups(before, True)}::{_groups(7 - before)}")
        if before <= 5:
            forms.append(f"{_groups(before, True)}::(?:{_H}:){{0,{5 - before}}}{FORMATS['ipv4']}")
    return "|".join(f"(?:{form})" for form in forms)


FORMATS["ipv6"] = _ipv6()
FORMATS["ipvanyaddress"] = f"{FORMATS['ipv4']}|{FORMATS['ipv6']}"  # pydantic's IPvAnyAddress
PLAIN_FORMATS = {"path", "password", "binary"}  # pydantic's Path, SecretStr, bytes: any string
# A URI (RFC 3986) of the schemes models are asked for: a host after the hierarchical ones'
# "//" (a file's may be empty), then unreserved and reserved characters and percent-escapes;
# under minLength/maxLength, characters only (a repetition of one length: an escape is three
# characters, and a count cannot tell them apart). Any scheme would let a small model write
# "Wikipedia.::Wikipedia.com" (a URI, and no URL pydantic takes).
_URI_CHAR = r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]"
_SCHEMES = (
    r"(?:https?|ftps?|sftp|wss?|s3|gs|git|ssh)://[A-Za-z0-9\[]"
    rf"|file://{_URI_CHAR}|(?:mailto|urn|data|tel):{_URI_CHAR}"
)
FORMATS["uri"] = rf"(?:{_SCHEMES})(?:{_URI_CHAR}|%[0-9A-Fa-f]{{2}})*"
BOUNDED_FORMATS = {**FORMATS, "uri": rf"(?:{_SCHEMES}){_URI_CHAR}*"}


def other_members(
    schema: dict[str, Any], listed: list[str], string: Callable[[dict[str, Any]], str]
) -> list[tuple[str, Any]]:
    """The members an object may hold beside its listed properties, as (a key's pattern, the
    value's schema): keys other than the listed ones (``other_key``), valued as
    ``additionalProperties`` says (none where it is absent or false; a schema; true: any value,
    where properties are listed). On an object that lists none: keys ``propertyNames`` accepts
    (pydantic's ``dict[Literal[...], V]``), or each of ``patternProperties``' patterns with its
    value schema (only those keys: every document is the schema's). ``string``: the pattern of
    a string schema."""
    names, patterns = schema.get("propertyNames"), schema.get("patternProperties")
    extra = schema.get("additionalProperties")
    if names is None and patterns is None:
        if extra is None or extra is False or (extra is True and not listed):
            return []
        return [(f'"{other_key(listed)}"' if listed else STRING, extra)]
    if listed or (names is not None and patterns is not None):
        raise ValueError(
            "json_schema propertyNames and patternProperties are supported on an object "
            "without properties, one of them"
        )
    if patterns is not None:
        return [(string({"type": "string", "pattern": p}), sub) for p, sub in patterns.items()]
    if not isinstance(names, dict):
        raise ValueError("json_schema propertyNames is supported as a schema object")
    value = True if extra is None else extra
    return [] if value is False else [(string({"type": "string", **names}), value)]


def other_key(names: list[str]) -> str:
    """A key's characters (within its quotes) that spell none of ``names``: each character
    written one way only (no ``\\u`` or ``\\/`` escapes), so a key other than the listed ones
    cannot be one of them spelled another way. A trie of the names' spellings, and at each of
    its nodes every way to leave it."""
    spelled = []
    for name in names:
        text = json.dumps(name, ensure_ascii=False)[1:-1]
        units = re.findall(r"\\.|[^\\]", text)
        if "\\u" not in text:  # (a name spelled only with \u cannot be met here)
            spelled.append(tuple(units))

    def rest(group: list[tuple[str, ...]], at: int) -> str:
        ends = any(len(units) == at for units in group)
        nexts = sorted({units[at] for units in group if len(units) > at})
        chars = "".join(re.escape(u) for u in nexts if len(u) == 1)
        escapes = "".join(u[1] for u in nexts if len(u) == 2)
        others = [rf'[^"\\\x00-\x1f{chars}]']
        left = [c for c in '"\\bfnrt' if c not in escapes]
        if left:
            others.append(rf"\\[{''.join(re.escape(c) for c in left)}]")
        options = [f"(?:{'|'.join(others)}){KEY_CHAR}*"]
        for unit in nexts:
            after = rest([u for u in group if len(u) > at and u[at] == unit], at + 1)
            options.append(f"{re.escape(unit)}(?:{after})")
        body = "|".join(options)
        return body if ends else f"(?:{body})?"

    return rest(spelled, 0)


def format_tree(name: str, low: int, high: int | None) -> tuple:
    """The syntax tree of format ``name``: as :data:`BOUNDED_FORMATS` spells it where its full
    spelling has strings outside ``low`` to ``high`` characters."""
    tree = parse_regex(FORMATS[name])
    shortest, longest = _lengths(tree)
    if shortest >= low and (high is None or (longest is not None and longest <= high)):
        return tree
    return parse_regex(BOUNDED_FORMATS[name])


def within(tree: tuple, low: int, high: int | None, what: str) -> tuple:
    """``tree`` (a pattern's) with its strings cut to ``low`` to ``high`` characters: as it is
    where all its strings are within them. Where it ends in a repetition after a beginning of
    bounded length (``[a-z]+``, a URI's scheme then its characters), the repetition's counts
    are cut so that every string is within them: at least enough after the shortest
    beginning, at most what fits after the longest (all its strings where the beginning has
    one length and the item one, as one repeated character class). Any other pattern is
    refused: a regular expression cannot intersect two."""
    shortest, longest = _lengths(tree)
    if shortest >= low and (high is None or (longest is not None and longest <= high)):
        return tree
    items = list(tree[1]) if tree[0] == "cat" else [tree]
    last = items[-1] if items else ("cat", [])
    if last[0] == "rep":
        first, most = _lengths(("cat", items[:-1]))
        item_least, item_most = _lengths(last[1])
        if most is not None and item_most is not None and item_least > 0:
            bottom = max(last[2], -(-(low - first) // item_least))
            top = last[3]
            if high is not None:
                room = (high - most) // item_most
                top = room if top is None else min(top, room)
            if top is not None and top < bottom:
                raise ValueError(
                    f"json_schema {what} has no string of {low} to {high} characters (its "
                    "last repetition cut to fit after its longest beginning)"
                )
            return ("cat", [*items[:-1], ("rep", last[1], bottom, top)])
    raise ValueError(
        f"json_schema {what} with minLength/maxLength is supported where the pattern ends in "
        "a repetition after a beginning of bounded length, or all its strings are "
        f"{low} to {high} characters long"
    )


def _lengths(tree: tuple) -> tuple[int, int | None]:
    """The fewest and most characters of ``tree``'s strings (None: no most)."""
    kind = tree[0]
    if kind == "set":
        return 1, 1
    if kind == "cat" or kind == "alt":
        parts = [_lengths(item) for item in tree[1]] or [(0, 0)]
        highs = [h for _, h in parts]
        if kind == "cat":
            return sum(lo for lo, _ in parts), None if None in highs else sum(highs)  # type: ignore[arg-type]
        return min(lo for lo, _ in parts), None if None in highs else max(highs)  # type: ignore[type-var]
    lo, hi = _lengths(tree[1])
    most = None if tree[3] is None or hi is None else hi * tree[3]
    return lo * tree[2], most
