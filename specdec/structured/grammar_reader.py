"""Reading a grammar's text, EBNF or Lark (the notations: :mod:`specdec.structured.grammar`),
into rules: each rule's right-hand side as a small tree (:data:`Node`)."""

from __future__ import annotations

import re
from functools import lru_cache

from specdec.structured.regex import MAX_CODEPOINT, Ranges, complement, normalize, parse_regex

ANY: Ranges = [(0, MAX_CODEPOINT)]
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


def read_grammar(text: str) -> GrammarReader:
    """The grammar ``text``, its notation told by how its first rule is defined."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"grammar must be a non-empty string, got {text!r}")
    if re.search(r"^\s*[\w-]+\s*::=", text, re.M):
        return GrammarReader(text, lark=False)
    if re.search(r"^\s*[?!]?\w+(\.-?\d+)?\s*:", text, re.M):
        return GrammarReader(text, lark=True)
    raise ValueError("grammar: no rule found (EBNF: root ::= ...; Lark: start: ...)")


class GrammarReader:
    """A recursive-descent reader of one grammar: its ``rules`` (name -> tree), what ``%ignore``
    names (Lark), its ``root`` rule and notation (``lark``)."""

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
            for used in refs(self.rules[name]):
                if used not in self.rules:
                    raise self.error(f"rule {used!r} is used but not defined", line=False)

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
                known = [n.removeprefix(COMMON_PREFIX) for n in common]
                known = sorted(n for n in known if not n.startswith("_"))  # _EXP: a part
                raise self.error(f"common.{name} is not one of {', '.join(known)}")
            for used in {key, *closure(common, key)}:  # under their own names, as Lark does
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
            parse_regex(pattern)
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


@lru_cache(maxsize=1)
def _common() -> dict[str, Node]:
    """Lark's common terminals, each under :data:`COMMON_PREFIX` + its name."""
    return {
        COMMON_PREFIX + n: _renamed(r) for n, r in GrammarReader(COMMON, lark=True).rules.items()
    }


def _renamed(node: Node) -> Node:
    kind = node[0]
    if kind == "ref":
        return ("ref", COMMON_PREFIX + node[1])
    if kind in ("seq", "alt"):
        return (kind, [_renamed(n) for n in node[1]])
    return ("rep", _renamed(node[1]), *node[2:]) if kind == "rep" else node


def _set(ranges: Ranges) -> Node:
    return ("set", normalize(ranges))


def refs(node: Node) -> list[str]:
    kind = node[0]
    if kind == "ref":
        return [node[1]]
    if kind in ("seq", "alt"):
        return [r for n in node[1] for r in refs(n)]
    return refs(node[1]) if kind == "rep" else []


def closure(rules: dict[str, Node], name: str) -> set[str]:
    """The rules ``name`` uses, directly or not."""
    seen, stack = set(), [name]
    while stack:
        for used in refs(rules[stack.pop()]):
            if used not in seen:
                seen.add(used)
                stack.append(used)
    return seen
