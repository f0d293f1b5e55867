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
  terminals (:data:`COMMON`), ``%ignore`` (what it names may come before any terminal of a rule
  and at the end: the strings Lark's lexer accepts, token boundaries aside); ``//`` comments.

A context-free grammar is not regular, so its recursion is bounded: a rule that calls itself as
the first or last item of its alternatives only (``list ::= item | item "," list``) is a loop,
exactly; any other recursion is expanded while the rule is open at most :data:`MAX_DEPTH` times
(for ``expr ::= "(" expr ")" | ...``: 3 levels of parentheses), deeper nesting being no match, as
:mod:`specdec.structured.json_schema` bounds free-form JSON. Outlines and XGrammar follow
grammars with a parser instead; this keeps one guide for every structured request.
"""

from __future__ import annotations

import re
from functools import lru_cache

from specdec.structured.regex import MAX_CODEPOINT, Ranges, check_regex, complement, normalize

MAX_DEPTH = 4  # times a recursive rule may be open within itself
MAX_PATTERN = 200_000  # characters of the expanded regular expression
ANY: Ranges = [(0, MAX_CODEPOINT)]
SURROGATES: Ranges = [(0xD800, 0xDFFF)]  # no UTF-8 encoding: never a character of the output
ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0", "b": "\b"}
HEX_WIDTH = {"x": 2, "u": 4, "U": 8}
COMMON_PREFIX = "COMMON__"  # an imported terminal's own rules, apart from the grammar's
PRIORITY = re.compile(r"\.-?\d+")  # Lark's NAME.2
COMMON = r"""
DIGIT: "0".."9"
HEXDIGIT: "a".."f" | "A".."F" | DIGIT
INT: DIGIT+
SIGNED_INT: ["+" | "-"] INT
DECIMAL: INT "." INT? | "." INT
_EXP: ("e" | "E") SIGNED_INT
FLOAT: INT _EXP | DECIMAL _EXP?
SIGNED_FLOAT: ["+" | "-"] FLOAT
NUMBER: FLOAT | INT
SIGNED_NUMBER: ["+" | "-"] NUMBER
ESCAPED_STRING: "\"" /(?:[^"\\\n]|\\.)*/ "\""
LCASE_LETTER: "a".."z"
UCASE_LETTER: "A".."Z"
LETTER: UCASE_LETTER | LCASE_LETTER
WORD: LETTER+
CNAME: ("_" | LETTER) ("_" | LETTER | DIGIT)*
WS_INLINE: (" " | "\t")+
WS: /[ \t\f\r\n]/+
CR: "\r"
LF: "\n"
NEWLINE: (CR? LF)+
"""  # Lark's common.lark, the terminals' languages as this module reads them

Node = tuple  # ("lit", str) | ("set", ranges) | ("re", pattern) | ("ref", name)
# | ("seq", [nodes]) | ("alt", [nodes]) | ("rep", node, low, high or None)


@lru_cache(maxsize=64)
def grammar_regex(text: str) -> str:
    """The regular expression of the grammar ``text`` (EBNF or Lark; ValueError naming what is
    wrong or unsupported)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"grammar must be a non-empty string, got {text!r}")
    if re.search(r"^\s*[\w-]+\s*::=", text, re.M):
        grammar = _Grammar(text, lark=False)
    elif re.search(r"^\s*[?!]?\w+(\.-?\d+)?\s*:", text, re.M):
        grammar = _Grammar(text, lark=True)
    else:
        raise ValueError("grammar: no rule found (EBNF: root ::= ...; Lark: start: ...)")
    return grammar.regex()


class _Grammar:
    """A recursive-descent reader of one grammar (see the module docstring), and its expansion."""

    def __init__(self, text: str, lark: bool):
        self.text, self.i, self.lark = text, 0, lark
        self.rules: dict[str, Node] = {}
        self.ignored: list[Node] = []
        self.root = "start" if lark else "root"
        while self.skip() is not None:
            if lark and self.text.startswith("%", self.i):
                self.directive()
            else:
                self.rule()
        for name in self.rules:
            for used in _refs(self.rules[name]):
                if used not in self.rules:
                    raise self.error(f"rule {used!r} is used but not defined", line=False)

    # -- reading

    def error(self, what: str, line: bool = True) -> ValueError:
        """A ValueError saying ``what``, at the line being read if ``line``."""
        where = f" at line {self.text.count(chr(10), 0, self.i) + 1}" if line else ""
        return ValueError(f"grammar: {what}{where}")

    def skip(self, newlines: bool = True) -> str | None:
        """Skip blanks and comments; the next character (None at the end)."""
        comment = "//" if self.lark else "#"
        while self.i < len(self.text):
            c = self.text[self.i]
            if c == "\n" and not newlines:
                break
            if c.isspace():
                self.i += 1
            elif self.text.startswith(comment, self.i):
                end = self.text.find("\n", self.i)
                self.i = len(self.text) if end < 0 else end
            else:
                return c
        return None

    def name(self) -> str:
        pattern = r"[A-Za-z_]\w*" if self.lark else r"[A-Za-z0-9_-]+"
        match = re.compile(pattern).match(self.text, self.i)
        if not match:
            raise self.error(f"expected a rule name, found {self.text[self.i : self.i + 10]!r}")
        self.i = match.end()
        return match.group()

    def at_definition(self) -> bool:
        head = r"[?!]?\w+(\.-?\d+)?\s*:(?!:)" if self.lark else r"[\w-]+\s*::="
        return re.compile(head).match(self.text, self.i) is not None

    def rule(self) -> None:
        if self.lark and self.text[self.i] in "?!":
            self.i += 1
        name = self.name()
        if self.lark and (priority := PRIORITY.match(self.text, self.i)):
            self.i = priority.end()  # a lexer's preference: the strings are the same
        self.skip(newlines=False)
        arrow = ":" if self.lark else "::="
        if not self.text.startswith(arrow, self.i):
            raise self.error(f"expected {arrow!r} after {name!r}")
        self.i += len(arrow)
        self.define(name, self.alternatives())

    def define(self, name: str, node: Node) -> None:
        if name in self.rules:
            raise self.error(f"rule {name!r} is defined twice")
        self.rules[name] = node

    def directive(self) -> None:
        line_end = self.text.find("\n", self.i)
        line = self.text[self.i : len(self.text) if line_end < 0 else line_end]
        if line.startswith("%ignore"):
            self.i += len("%ignore")
            self.ignored.append(self.alternatives())
            return
        found = re.fullmatch(r"%import\s+common\s*(?:\.(\w+)(?:\s*->\s*(\w+))?|\(([\w\s,]+)\))\s*"
                             r"(?://.*)?", line)  # fmt: skip
        if not found:
            raise self.error(
                f"{line.strip()!r}: only %import common.NAME and %ignore are supported"
            )
        common = _common()
        names = [found[1]] if found[1] else [n.strip() for n in found[3].split(",") if n.strip()]
        for name in names:
            key = COMMON_PREFIX + name
            if key not in common:
                known = sorted(n.removeprefix(COMMON_PREFIX) for n in common)
                raise self.error(f"common.{name} is not one of {', '.join(known)}")
            for used in {key, *_closure(common, key)}:  # under their own names, as Lark does
                self.rules[used] = common[used]
            self.define(found[2] or name, ("ref", key))
        self.i += len(line)

    def alternatives(self) -> Node:
        options = [self.sequence()]
        while self.skip() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self) -> Node:
        items: list[Node] = []
        while True:
            c = self.skip()
            if c is None or c in "|)]" or self.at_definition() or (self.lark and c == "%"):
                break
            if self.lark and self.text.startswith("->", self.i):
                self.i += 2
                self.skip(newlines=False)
                self.name()  # an alias names the tree's node; the strings are the same
                continue
            items.append(self.postfix(self.atom()))
        return items[0] if len(items) == 1 else ("seq", items)

    def atom(self) -> Node:
        c = self.text[self.i]
        self.i += 1
        if c == "(":
            node = self.alternatives()
            self.expect(")")
            return node
        if c == "[" and self.lark:
            node = self.alternatives()
            self.expect("]")
            return ("rep", node, 0, 1)
        if c == "[":
            return _set(self.char_class())
        if c == '"' or (c == "'" and not self.lark):
            return self.string(c)
        if c == "/" and self.lark:
            return self.regexp()
        if c == "." and not self.lark:
            return ("set", ANY)
        self.i -= 1
        if c == "{" and self.lark:
            raise self.error("template rules (name{...}) are not supported")
        if c.isalnum() or c in "_-":
            return ("ref", self.name())
        raise self.error(f"unexpected {c!r}")

    def expect(self, c: str) -> None:
        if self.skip() != c:
            raise self.error(f"missing {c!r}")
        self.i += 1

    def char(self, quote: str) -> int:
        """One character of a literal or class (its escapes read), as a code point."""
        if self.i >= len(self.text):
            raise self.error(f"missing closing {quote!r}")
        c = self.text[self.i]
        self.i += 1
        if c != "\\":
            return ord(c)
        c = self.text[self.i : self.i + 1]
        self.i += 1
        if c in ESCAPES:
            return ord(ESCAPES[c])
        if c in HEX_WIDTH:
            digits = self.text[self.i : self.i + HEX_WIDTH[c]]
            if not re.fullmatch(r"[0-9a-fA-F]+", digits) or len(digits) != HEX_WIDTH[c]:
                raise self.error(f"bad \\{c} escape")
            self.i += HEX_WIDTH[c]
            if int(digits, 16) > MAX_CODEPOINT:
                raise self.error(f"\\{c}{digits} is past the last code point")
            return int(digits, 16)
        if c == "" or c.isalnum():
            raise self.error(f"unsupported escape \\{c}")
        return ord(c)

    def string(self, quote: str) -> Node:
        chars = []
        while not self.text.startswith(quote, self.i):
            chars.append(self.char(quote))
        self.i += 1
        if self.lark and self.text.startswith("..", self.i):  # "a".."z"
            self.i += 2
            self.expect('"')
            high = self.string('"')
            if len(chars) != 1 or high[0] != "lit" or len(high[1]) != 1 or ord(high[1]) < chars[0]:
                raise self.error('a range needs two single characters, low to high ("a".."z")')
            return _set([(chars[0], ord(high[1]))])
        if self.lark and self.text.startswith("i", self.i) and not self.at_word(self.i + 1):
            self.i += 1
            return ("seq", [_set(normalize([(ord(x), ord(x)) for x in {chr(c).lower(),
                    chr(c).upper(), chr(c)}])) for c in chars])  # fmt: skip
        return ("lit", "".join(chr(c) for c in chars))

    def at_word(self, i: int) -> bool:
        return i < len(self.text) and (self.text[i].isalnum() or self.text[i] == "_")

    def char_class(self) -> Ranges:
        negate = self.text.startswith("^", self.i)
        self.i += negate
        ranges: Ranges = []
        while not self.text.startswith("]", self.i):
            low = self.char("]")
            high = low
            if self.text.startswith("-", self.i) and not self.text.startswith("-]", self.i):
                self.i += 1
                high = self.char("]")
                if high < low:
                    raise self.error("a class range runs from high to low")
            ranges.append((low, high))
        self.i += 1
        return complement(ranges) if negate else normalize(ranges)

    def regexp(self) -> Node:
        match = re.compile(r"((?:[^/\\\n]|\\.)*)/([a-z]*)").match(self.text, self.i)
        if not match:
            raise self.error("missing closing '/'")
        self.i = match.end()
        pattern = match[1].replace("\\/", "/")
        if match[2]:
            raise self.error(f"/{match[1]}/{match[2]}: regexp flags are not supported")
        try:
            check_regex(pattern)
        except ValueError as e:
            raise self.error(f"/{match[1]}/: {e}") from None
        return ("re", pattern)

    def postfix(self, node: Node) -> Node:
        while True:
            c = self.text[self.i : self.i + 1]
            if c in ("*", "+", "?") and c:
                self.i += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and not self.lark:
                found = re.compile(r"\{\s*(\d*)\s*(,?)\s*(\d*)\s*\}").match(self.text, self.i)
                if not found or not (found[1] or found[3]):
                    raise self.error("bad repetition, expected {m}, {m,}, {m,n} or {,n}")
                self.i = found.end()
                low = int(found[1] or 0)
                high = (int(found[3]) if found[3] else None) if found[2] else low
            elif self.lark and self.skip(newlines=False) == "~":
                found = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?").match(self.text, self.i)
                if not found:
                    raise self.error("bad repetition, expected ~ n or ~ n..m")
                self.i = found.end()
                low, high = int(found[1]), int(found[2] or found[1])
            else:
                return node
            if high is not None and high < low:
                raise self.error(f"repetition from {low} down to {high}")
            node = ("rep", node, low, high)

    # -- expansion

    def regex(self) -> str:
        if self.root not in self.rules:
            raise self.error(f"no {self.root!r} rule: the output must match one", line=False)
        self.groups = _groups(self.rules)
        self.memo: dict[tuple, str | None] = {}
        self.ignore: str | None = None  # what %ignore allows before a terminal of a rule
        ignored = [p for p in (self.emit(n, (), True) for n in self.ignored) if p]
        self.ignore = "(?:" + "|".join(ignored) + ")*" if ignored else None
        pattern = self.emit(("ref", self.root), (), False)
        if pattern is None:
            raise self.error("the grammar matches no string within its recursion bound", line=False)
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
        if open_rules.count(name) >= MAX_DEPTH:
            return None
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
            raise self.error(
                f"rule {name!r} expands to a regular expression of over {MAX_PATTERN:,} "
                f"characters: nest its recursive rules less",
                line=False,
            )
        self.memo[key] = out
        return out


@lru_cache(maxsize=1)
def _common() -> dict[str, Node]:
    """Lark's common terminals, each under :data:`COMMON_PREFIX` + its name."""
    return {COMMON_PREFIX + n: _renamed(r) for n, r in _Grammar(COMMON, lark=True).rules.items()}


def _renamed(node: Node) -> Node:
    kind = node[0]
    if kind == "ref":
        return ("ref", COMMON_PREFIX + node[1])
    if kind in ("seq", "alt"):
        return (kind, [_renamed(n) for n in node[1]])
    return ("rep", _renamed(node[1]), *node[2:]) if kind == "rep" else node


def _set(ranges: Ranges) -> Node:
    return ("set", normalize(ranges))


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


def _refs(node: Node) -> list[str]:
    kind = node[0]
    if kind == "ref":
        return [node[1]]
    if kind in ("seq", "alt"):
        return [r for n in node[1] for r in _refs(n)]
    return _refs(node[1]) if kind == "rep" else []


def _closure(rules: dict[str, Node], name: str) -> set[str]:
    """The rules ``name`` uses, directly or not."""
    seen, stack = set(), [name]
    while stack:
        for used in _refs(rules[stack.pop()]):
            if used not in seen:
                seen.add(used)
                stack.append(used)
    return seen


def _groups(rules: dict[str, Node]) -> dict[str, frozenset[str]]:
    """Each rule's recursion group: the rules it uses that use it (itself only, if recursive;
    none, if not). Only their open counts can change how it expands."""
    reach = {name: _closure(rules, name) for name in rules}
    return {n: frozenset(r for r in reach[n] if n in reach[r]) for n in rules}


def _loop(name: str, body: Node) -> tuple[str, list[Node], list[Node]] | None:
    """A rule whose only recursion is itself at the same end of some alternatives (``R ::= a |
    b R`` or ``R ::= a | R b``): the side, the base alternatives and the steps; else None."""
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
            if any(name in _refs(n) for n in rest):
                break
        else:
            if steps and bases:
                return side, bases, steps
    return None
