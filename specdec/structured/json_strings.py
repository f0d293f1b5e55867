"""Strings in a JSON Schema's patterns: a pattern or format cut to ``minLength`` and
``maxLength``, and object keys other than the listed properties."""

from __future__ import annotations

import json
import re

KEY_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\bfnrt])'  # a character with one spelling only


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


def within(tree: tuple, low: int, high: int | None, what: str) -> tuple:
    """``tree`` (a pattern's) with its strings cut to ``low`` to ``high`` characters: as it is
    where all its strings are within them; one repeated character class gets the tighter
    counts; any other pattern is refused (a regular expression cannot intersect two)."""
    core = tree[1][0] if tree[0] == "cat" and len(tree[1]) == 1 else tree
    if core[0] == "rep" and core[1][0] == "set":
        top = core[3] if high is None else high if core[3] is None else min(high, core[3])
        bottom = max(low, core[2])
        if top is not None and top < bottom:
            raise ValueError(f"json_schema {what} has no string of {low} to {high} characters")
        return ("rep", core[1], bottom, top)
    shortest, longest = _lengths(tree)
    if shortest >= low and (high is None or (longest is not None and longest <= high)):
        return tree
    raise ValueError(
        f"json_schema {what} with minLength/maxLength is supported where the pattern is one "
        f"repeated character class or all its strings are {low} to {high} characters long"
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
