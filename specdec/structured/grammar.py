"""Grammars (vLLM's ``guided_grammar`` and ``structured_outputs.grammar``) as regular
expressions, for the byte-DFA guide of :mod:`specdec.structured.guide`.

Two notations are read, told apart by how a rule is defined:

- **EBNF** as llama.cpp's GBNF and XGrammar (vLLM's default backend) write it: ``name ::= ...``,
  the output matches ``root``; ``"literal"`` (``\\n \\t \\xhh \\uhhhh \\Uhhhhhhhh`` escapes),
  ``[a-z]`` and ``[^...]`` classes, ``.`` (any character), ``( )``, ``|``, ``* + ?`` and
  ``{m} {m,} {m,n}``; ``#`` comments.
- **Lark**'s: ``name: ...`` (``?name``, ``!name``, priorities and ``-> alias`` are accepted and
  shape nothing here), the output matches ``start``; ``"literal"`` (``"..."i`` ignoring case),
  ``/regexp/`` (:mod:`specdec.structured.regex`'s syntax, no flags), ``"a".."z"``, ``[item]``
  (optional), ``item ~ n`` and ``item ~ n..m``; ``%import common.NAME`` for Lark's common
  terminals (:data:`~specdec.structured.grammar_reader.COMMON`), ``%ignore`` (what it names may
  come before any terminal of a rule and at the end: the strings Lark's lexer accepts, token
  boundaries aside); ``//`` comments.

A context-free grammar is not regular. A rule that calls itself as the first or last item of its
alternatives only (``list ::= item | item "," list``, or ``ws ::= (" " ws)?``) is a loop,
exactly, and a grammar whose recursion is all loops is one regular expression. Any other
recursion (``expr ::= "(" expr ")" | ...``) is written by :func:`grammar_rules` as patterns that
call each other, ``(?&n)``, where a rule would open within itself, for the pushdown guide of
:mod:`specdec.structured.pushdown`: nesting is followed as deep as the output goes, as Outlines
and XGrammar follow grammars with a parser. :func:`grammar_regex` instead expands that recursion
while the rule is open at most ``depth`` times within itself (deeper nesting being no match):
one regular expression, for checking outputs against (the guided benchmark, tests).
"""

from __future__ import annotations

import re
from functools import lru_cache

from specdec.structured.grammar_reader import GrammarReader, Node, closure, read_grammar, refs
from specdec.structured.regex import Ranges, TooLarge, complement

MAX_DEPTH = 4  # times a recursive rule may be open within itself (grammar_regex)
CALL_DEPTH = 1  # the same, for patterns that call rules past it (grammar_rules)
MAX_PATTERN = 200_000  # characters of the expanded regular expression (TooLarge past it)
SURROGATES: Ranges = [(0xD800, 0xDFFF)]  # no UTF-8 encoding: never a character of the output


@lru_cache(maxsize=64)
def grammar_regex(text: str, depth: int = MAX_DEPTH) -> str:
    """The regular expression of the grammar ``text`` (EBNF or Lark; ValueError naming what is
    wrong or unsupported), its recursion expanded while a rule is open at most ``depth`` times
    within itself."""
    return _Expansion(read_grammar(text), depth).regex()


@lru_cache(maxsize=64)
def grammar_rules(text: str, depth: int = CALL_DEPTH) -> tuple[str, ...]:
    """The grammar ``text`` as patterns that call each other, its recursion unbounded: where a
    rule would be open more than ``depth`` times within itself, the pattern calls it instead,
    ``(?&n)`` for the n-th pattern (:func:`~specdec.structured.regex.parse_regex` with
    ``calls``); the first pattern is the whole output's. One pattern only: the grammar is
    regular as written (its recursion loops)."""
    grammar = read_grammar(text)
    expansion = _Expansion(grammar, depth, calls=True)
    cycle = _left_cycle(grammar.rules)
    if cycle:
        raise expansion.error(
            f"rule {cycle[0]!r} is left-recursive (through {' -> '.join(cycle)}): it calls itself "
            "before any character, which only a rule calling itself directly may do (a loop)"
        )
    patterns = [expansion.regex()]
    while len(patterns) <= len(expansion.called):
        name, lexical = expansion.called[len(patterns) - 1]
        pattern = expansion.call(name, (), lexical)
        assert pattern is not None  # a productive rule (a call is made to no other)
        patterns.append(pattern)
    return tuple(patterns)


def _left_cycle(rules: dict[str, Node]) -> list[str]:
    """Rules that call each other before any character, round to the first (none: [])."""
    nullable: set[str] = set()

    def empty(node: Node) -> bool:  # whether node derives ""
        kind = node[0]
        if kind == "ref":
            return node[1] in nullable
        if kind in ("seq", "alt"):
            test = all if kind == "seq" else any
            return test(empty(n) for n in node[1])
        if kind == "rep":
            return node[2] == 0 or empty(node[1])
        return kind == "re" and re.fullmatch(node[1], "") is not None

    while more := {n for n, body in rules.items() if n not in nullable and empty(body)}:
        nullable |= more

    def first(node: Node) -> set[str]:  # the rules node may open before any character
        kind = node[0]
        if kind == "ref":
            return {node[1]}
        if kind == "alt":
            return set().union(*(first(n) for n in node[1]))
        if kind == "seq":
            out: set[str] = set()
            for n in node[1]:
                out |= first(n)
                if not empty(n):
                    break
            return out
        return first(node[1]) if kind == "rep" else set()

    def body(name: str) -> Node:  # a loop's own call is no call (grammar_rules writes a loop)
        loop = _loop(name, rules[name])
        return rules[name] if loop is None else ("alt", loop[1] + loop[2])

    edges = {name: first(body(name)) for name in rules}
    for start in rules:
        parent: dict[str, str] = {}
        todo = [start]
        while todo:
            at = todo.pop()
            for nxt in sorted(edges[at]):
                if nxt == start:
                    back = [at]
                    while back[-1] != start:
                        back.append(parent[back[-1]])
                    return [*reversed(back), start]
                if nxt not in parent:
                    parent[nxt] = at
                    todo.append(nxt)
    return []


def _productive(rules: dict[str, Node]) -> set[str]:
    """The rules that derive some string (the others recurse without end, or use such)."""
    found: set[str] = set()

    def derives(node: Node) -> bool:
        kind = node[0]
        if kind == "ref":
            return node[1] in found
        if kind == "seq":
            return all(derives(n) for n in node[1])
        if kind == "alt":
            return any(derives(n) for n in node[1])
        if kind == "rep":
            return node[2] == 0 or derives(node[1])
        return kind != "set" or bool(_class(node[1]))

    while True:
        more = {name for name, body in rules.items() if name not in found and derives(body)}
        if not more:
            return found
        found |= more


class _Expansion:
    """A grammar's rules written out as one regular expression from its root."""

    def __init__(self, grammar: GrammarReader, depth: int, calls: bool = False):
        self.rules, self.lark, self.depth = grammar.rules, grammar.lark, depth
        # calls: past the depth a rule is called (its pattern numbered by its place here + 1);
        # a rule that derives no string (its recursion never ends) matches nothing
        self.calls, self.called = calls, list[tuple[str, bool]]()
        self.productive = _productive(self.rules) if calls else set(self.rules)
        self.ignored, self.root = grammar.ignored, grammar.root
        self.groups = _groups(self.rules)
        self.memo: dict[tuple, str | None] = {}
        self.ignore: str | None = None  # what %ignore allows before a terminal of a rule

    def error(self, what: str) -> ValueError:
        return ValueError(f"grammar: {what}")

    def regex(self) -> str:
        if self.root not in self.rules:
            raise self.error(f"no {self.root!r} rule: the output must match one")
        ignored = [p for p in (self.emit(n, (), True) for n in self.ignored) if p]
        self.ignore = "(?:" + "|".join(ignored) + ")*" if ignored else None
        pattern = self.emit(("ref", self.root), (), False)
        if pattern is None:
            bound = "" if self.calls else " within its recursion bound"
            raise self.error(f"the grammar matches no string{bound}")
        return pattern + (self.ignore or "")

    def emit(self, node: Node, open_rules: tuple[str, ...], lexical: bool) -> str | None:
        """``node`` as a regex (None: it matches nothing), inside the rules ``open_rules``;
        ``lexical``: inside a terminal, where ``%ignore`` does not apply."""
        kind = node[0]
        if kind == "lit":
            return self.token(_literal(node[1]), lexical)
        if kind == "set":
            return self.token(_class(node[1]), lexical)
        if kind == "re":
            return self.token(f"(?:{node[1]})", lexical)
        if kind == "seq":
            parts = [self.emit(n, open_rules, lexical) for n in node[1]]
            return None if None in parts else "".join(p for p in parts if p is not None)
        if kind == "alt":
            parts = [self.emit(n, open_rules, lexical) for n in node[1]]
            kept = list(dict.fromkeys(p for p in parts if p is not None))
            return None if not kept else "(?:" + "|".join(kept) + ")"
        if kind == "rep":
            inner = self.emit(node[1], open_rules, lexical)
            if inner is None or inner == "":
                return "" if node[2] == 0 or inner == "" else None
            return _repeat(inner, node[2], node[3])
        out = self.call(node[1], open_rules, lexical)
        return out if lexical or not self.terminal(node[1]) else self.token(out, lexical)

    def terminal(self, name: str) -> bool:
        return self.lark and name.lstrip("_")[:1].isupper()

    def token(self, text: str | None, lexical: bool) -> str | None:
        """A terminal's regex, after what ``%ignore`` allows before it in a rule."""
        return text if lexical or text is None or self.ignore is None else self.ignore + text

    def call(self, name: str, open_rules: tuple[str, ...], lexical: bool) -> str | None:
        lexical = lexical or self.terminal(name)
        group = self.groups[name]
        key = (name, lexical, tuple(open_rules.count(r) for r in sorted(group)))
        if key in self.memo:
            return self.memo[key]
        if name not in self.productive or (open_rules.count(name) >= self.depth and not self.calls):
            return None
        if open_rules.count(name) >= self.depth:
            if (name, lexical) not in self.called:
                self.called.append((name, lexical))
            return f"(?&{self.called.index((name, lexical)) + 1})"
        inner = (*open_rules, name)
        loop = _loop(name, self.rules[name])
        if loop is None:
            out = self.emit(self.rules[name], inner, lexical)
        else:  # R ::= a | b R  is  b* a;  R ::= a | R b  is  a b*
            side, bases, steps = loop
            base = self.emit(("alt", bases), inner, lexical)
            step = self.emit(("alt", steps), inner, lexical) if steps else None
            loops = "" if step is None or step == "" else f"(?:{step})*"
            out = None if base is None else (loops + base if side == "right" else base + loops)
        if out is not None and len(out) > MAX_PATTERN:
            raise TooLarge(
                f"grammar: rule {name!r} expands to a regular expression of over "
                f"{MAX_PATTERN:,} characters: nest its recursive rules less"
            )
        self.memo[key] = out
        return out


def _literal(text: str) -> str:
    return "".join(_char(ord(c)) for c in text)


def _char(cp: int) -> str:
    c = chr(cp)
    if (c.isascii() and c.isalnum()) or c == " " or cp > 0xFFFF:
        return c  # no metacharacter is alphanumeric, a space or past the BMP
    return f"\\u{cp:04x}"


def _class(ranges: Ranges) -> str | None:
    kept = complement(complement(ranges) + SURROGATES)
    if not kept:
        return None  # no character: no match
    return "[" + "".join(_char(lo) + ("" if lo == hi else "-" + _char(hi)) for lo, hi in kept) + "]"


def _repeat(inner: str, low: int, high: int | None) -> str:
    if (low, high) in ((0, None), (1, None), (0, 1)):
        return f"(?:{inner})" + {(0, None): "*", (1, None): "+", (0, 1): "?"}[(low, high)]
    return (
        f"(?:{inner}){{{low},{'' if high is None else high}}}"
        if high != low
        else (f"(?:{inner}){{{low}}}")
    )


def _groups(rules: dict[str, Node]) -> dict[str, frozenset[str]]:
    """Each rule's recursion group: the rules it uses that use it (itself only, if recursive;
    none, if not). Only their open counts can change how it expands."""
    reach = {name: closure(rules, name) for name in rules}
    return {n: frozenset(r for r in reach[n] if n in reach[r]) for n in rules}


def _loop(name: str, body: Node) -> tuple[str, list[Node], list[Node]] | None:
    """A rule whose only recursion is itself at the same end of some alternatives (``R ::= a |
    b R`` or ``R ::= a | R b``, or ``R ::= (b R)?``): the side, the base alternatives and the
    steps; else None."""
    if body[0] == "rep" and body[2:] == (0, 1):  # (x)? is x | ""
        body = ("alt", [*(body[1][1] if body[1][0] == "alt" else [body[1]]), ("seq", [])])
    options = body[1] if body[0] == "alt" else [body]
    for side, at in (("right", -1), ("left", 0)):
        bases, steps = [], []
        for option in options:
            items = option[1] if option[0] == "seq" else [option]
            rest = items
            if items and items[at] == ("ref", name):
                rest = items[:-1] if at == -1 else items[1:]
                steps.append(("seq", rest))
            else:
                bases.append(option)
            if any(name in refs(n) for n in rest):
                break
        else:
            if steps and bases:
                return side, bases, steps
    return None
