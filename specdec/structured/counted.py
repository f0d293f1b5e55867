"""Repetitions with large counts, kept as counters rather than unrolled.

A byte DFA spells ``X{0,n}`` as n copies of ``X``'s states: a JSON string of at most 2,000
characters is 2,000 copies of a character's 21 to 26 states (UTF-8's lead bytes, escapes),
past what a guide can compile. :func:`counted` rewrites every repetition whose bound reaches
:data:`COUNT_FROM` as a call to a rule of its own, ``("count", rule, low, high)``, whose
automaton (:func:`~specdec.structured.automaton.counter`) reads nothing itself: state c calls
``X`` (a rule too) and goes on to state c + 1. The pushdown guide keeps the count on its return
stack, so a repetition costs ``X``'s states once, whatever its bound, as XGrammar and
llguidance keep repetition counts out of their automata.

A repetition of something that may be empty stays unrolled: a counter would step through its
counts without reading a byte.
"""

from __future__ import annotations

from specdec.structured.automaton import derives

COUNT_FROM = 1_000  # a repetition is counted where its bound times its item's size reaches it
MIN_COUNT = 16  # and its bound this at least


def counted(trees: list[tuple]) -> list[tuple]:
    """``trees`` (a guide's rules, the first its whole output's; ``("call", n)`` is rule n) with
    each repetition bounded at :data:`COUNT_FROM` or more replaced by a call to a new
    ``("count", rule, low, high)`` rule over a new rule of what it repeats (equal ones
    shared); the others as they are."""
    out = list(trees)
    empty = derives(trees, lambda node: node[0] == "avoid")  # may match nothing (free text may)
    rules: dict[str, int] = {}  # a rule's repr -> its index among out

    def rule(tree: tuple) -> int:
        key = repr(tree)
        if key not in rules:
            rules[key] = len(out)
            out.append(tree)
        return rules[key]

    def visit(node: tuple) -> tuple:
        kind = node[0]
        if kind in ("cat", "alt"):
            return (kind, [visit(item) for item in node[1]])
        if kind != "rep":
            return node
        _, inner, low, high = node
        bound = low if high is None else high
        if bound < MIN_COUNT or bound * _size(inner) < COUNT_FROM or empty(inner):
            return ("rep", visit(inner), low, high)
        inner = visit(inner)
        called = inner[1] if inner[0] == "call" else rule(inner)
        return ("call", rule(("count", called, low, high)))

    for i, tree in enumerate(trees):
        out[i] = visit(tree)
    return out


def _size(node: tuple) -> int:
    """About how many automaton states ``node`` unrolls to: a character set's UTF-8 length
    (its longest character's bytes), repetitions multiplied out."""
    kind = node[0]
    if kind == "set":
        top = max((hi for _, hi in node[1]), default=0)
        return 1 + (top > 0x7F) + (top > 0x7FF) + (top > 0xFFFF)
    if kind in ("cat", "alt"):
        return sum(_size(item) for item in node[1])
    if kind == "rep":
        return _size(node[1]) * max(1, node[2] if node[3] is None else node[3])
    return 1  # a call (another automaton), free text (a few states)
