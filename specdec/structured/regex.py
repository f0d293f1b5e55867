"""Regular expressions compiled to a DFA over UTF-8 bytes, for guided decoding.

The model emits tokens, each a few bytes that may split a character, so a pattern becomes an
automaton over bytes: parsed (:class:`_Parser`, Python's ``re`` syntax in part), a Thompson NFA
whose character sets are spelled as UTF-8 byte ranges (after RE2's construction), then a dense
DFA by subset construction (:mod:`specdec.structured.automaton`). Outlines (Willard
and Louf 2023) and vLLM index a vocabulary against such an automaton, as
:mod:`specdec.structured.guide` does.

Supported: literals, ``.`` (not a newline), ``[a-z]``, ``[^...]``, the escapes ``\\d \\w \\s
\\D \\W \\S`` (ASCII, as under ``re.ASCII`` and in JSON Schema), ``\\n \\t \\r \\f \\v``,
``\\xhh``, ``\\uhhhh`` and escaped metacharacters, ``(...)``, ``(?:...)``, ``|``, and ``* + ? {n} {n,} {,m} {n,m}``
(lazy forms too); ``^`` and ``$`` at the ends only (a match is always whole). Backreferences,
lookarounds, flags and patterns past the automaton's limits are refused with a ValueError.
"""

from __future__ import annotations

# the automata, for the modules that compile patterns (re-exported)
from specdec.structured.automaton import DEAD as DEAD
from specdec.structured.automaton import DFA as DFA
from specdec.structured.automaton import TooLarge as TooLarge
from specdec.structured.automaton import compile_tree as compile_tree
from specdec.structured.automaton import counter as counter

MAX_CODEPOINT = 0x10FFFF
MAX_REPEAT = 100_000  # the largest {n,m} bound (large ones are counted: structured/counted.py)
MAX_NESTING = 100  # groups within groups

Ranges = list[tuple[int, int]]  # sorted, disjoint, inclusive code point ranges

DIGIT: Ranges = [(0x30, 0x39)]
WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20)]
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
CLASSES = {"d": DIGIT, "w": WORD, "s": SPACE}


def normalize(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in normalize(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    return out + ([(start, MAX_CODEPOINT)] if start <= MAX_CODEPOINT else [])


def shown(pattern: str, limit: int = 80) -> str:
    """``pattern`` quoted for an error message, cut short if long (a schema's can be huge)."""
    return repr(pattern) if len(pattern) <= limit else repr(pattern[:limit]) + "..."


# -- the parse tree: ("set", ranges) | ("cat", [nodes]) | ("alt", [nodes]) | ("rep", node, m, n)


class _Parser:
    """A recursive-descent parser of the supported subset (see the module docstring)."""

    def __init__(self, pattern: str, calls: bool = False):
        self.p, self.i, self.depth, self.calls = pattern, 0, 0, calls

    def error(self, what: str) -> ValueError:
        return ValueError(f"regex {shown(self.p)}: {what} at position {self.i}")

    def parse(self) -> tuple:
        if self.p.startswith("^"):
            self.i = 1
        node = self.alternation()
        if self.i < len(self.p) and self.p[self.i :] == "$":
            self.i += 1
        if self.i < len(self.p):
            raise self.error(f"unexpected {self.p[self.i]!r}")
        return node

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def alternation(self) -> tuple:
        options = [self.concatenation()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.concatenation())
        return options[0] if len(options) == 1 else ("alt", options)

    def concatenation(self) -> tuple:
        items = []
        while self.peek() not in (None, "|", ")"):
            if self.p[self.i :] == "$":
                break
            items.append(self.quantified(self.atom()))
        return ("cat", items)

    def quantified(self, node: tuple) -> tuple:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{" and self._is_bound():
            low, high = self.bound()
        else:
            return node
        if self.peek() == "?":  # lazy: the same strings match
            self.i += 1
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self._is_bound()):
            raise self.error("possessive or repeated quantifiers are not supported")
        return ("rep", node, low, high)

    def _is_bound(self) -> bool:
        end = self.p.find("}", self.i)
        body = self.p[self.i + 1 : end] if end > 0 else ""
        return bool(body) and all(part.strip().isdigit() or part == "" for part in body.split(","))

    def bound(self) -> tuple[int, int | None]:
        end = self.p.index("}", self.i)
        body, self.i = self.p[self.i + 1 : end], end + 1
        parts = body.split(",")
        if len(parts) > 2:
            raise self.error(f"bad repetition {{{body}}}")
        low = int(parts[0] or 0)  # {,n}: from none
        high = low if len(parts) == 1 else (int(parts[1]) if parts[1] else None)
        if high is not None and (high < low or high > MAX_REPEAT) or low > MAX_REPEAT:
            raise self.error(f"repetition {{{body}}} out of range (at most {MAX_REPEAT})")
        return low, high

    def atom(self) -> tuple:
        c = self.p[self.i]
        self.i += 1
        if c == "(":
            if self.p.startswith("?&", self.i) and self.calls:  # a grammar's rule, by number
                end = self.p.index(")", self.i)
                rule, self.i = int(self.p[self.i + 2 : end]), end + 1
                return ("call", rule)
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.error("lookarounds, flags and named groups are not supported")
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise self.error(f"groups nest more than {MAX_NESTING} deep")
            node = self.alternation()
            self.depth -= 1
            if self.peek() != ")":
                raise self.error("missing )")
            self.i += 1
            return node
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", complement([(0x0A, 0x0A)]))
        if c == "\\":
            return ("set", self.escape())
        if c in "*+?":
            raise self.error(f"nothing to repeat before {c!r}")
        if c in "^$":
            raise self.error(f"{c!r} is supported only at the ends of the pattern")
        return ("set", [(ord(c), ord(c))])

    def escape(self) -> Ranges:
        if self.i >= len(self.p):
            raise self.error("trailing backslash")
        c = self.p[self.i]
        self.i += 1
        if c.lower() in CLASSES:
            ranges = CLASSES[c.lower()]
            return complement(ranges) if c.isupper() else ranges
        if c in ESCAPES:
            return [(ord(ESCAPES[c]), ord(ESCAPES[c]))]
        if c in "xu":
            width = 2 if c == "x" else 4
            digits = self.p[self.i : self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"bad \\{c} escape")
            self.i += width
            return [(int(digits, 16), int(digits, 16))]
        if c.isalnum():
            raise self.error(f"unsupported escape \\{c} (backreferences, anchors, classes)")
        return [(ord(c), ord(c))]

    def char_class(self) -> Ranges:
        negate = self.peek() == "^"
        self.i += negate
        ranges: Ranges = []
        first = True
        while True:
            if self.i >= len(self.p):
                raise self.error("missing ]")
            c = self.p[self.i]
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            self.i += 1
            item = self.escape() if c == "\\" else [(ord(c), ord(c))]
            if (
                len(item) == 1 and item[0][0] == item[0][1]
                and self.peek() == "-" and self.p[self.i + 1 : self.i + 2] not in ("]", "")
            ):  # fmt: skip
                self.i += 1
                d = self.p[self.i]
                self.i += 1
                high = self.escape() if d == "\\" else [(ord(d), ord(d))]
                if len(high) != 1 or high[0][0] != high[0][1] or high[0][0] < item[0][0]:
                    raise self.error("bad range in a character class")
                item = [(item[0][0], high[0][0])]
            ranges += item
        return complement(ranges) if negate else normalize(ranges)


# -- Thompson NFA over bytes, then the DFA


def parse_regex(pattern: str, calls: bool = False) -> tuple:
    """``pattern``'s syntax tree, as :func:`compile_tree` takes it (ValueError if unsupported);
    ``calls``: read ``(?&n)``, PCRE's call of group n, as a call of a grammar's rule n (the
    patterns :func:`specdec.structured.grammar.grammar_rules` writes)."""
    return _Parser(pattern, calls).parse()


def restrict(tree: tuple, allowed: Ranges) -> tuple | None:
    """``tree`` with every character set cut to ``allowed`` (None: it then matches nothing):
    the strings it matches that hold only allowed characters."""
    kind = tree[0]
    if kind == "set":
        cut = normalize([(max(a, c), min(b, d)) for a, b in tree[1] for c, d in allowed
                         if max(a, c) <= min(b, d)])  # fmt: skip
        return ("set", cut) if cut else None
    if kind == "cat":
        items = [restrict(item, allowed) for item in tree[1]]
        return None if any(i is None for i in items) else ("cat", items)
    if kind == "alt":
        options = [o for o in (restrict(o, allowed) for o in tree[1]) if o is not None]
        return None if not options else options[0] if len(options) == 1 else ("alt", options)
    if kind == "rep":
        node = restrict(tree[1], allowed)
        if node is None:
            return ("cat", []) if tree[2] == 0 else None
        return ("rep", node, tree[2], tree[3])
    raise ValueError(f"cannot restrict a {kind!r} node")


def render(tree: tuple) -> str:
    """A pattern whose syntax tree is ``tree`` (:func:`parse_regex` of it gives ``tree`` back,
    up to grouping)."""
    kind = tree[0]
    if kind == "set":
        return (
            "[" + "".join(_char(a) + ("" if a == b else "-" + _char(b)) for a, b in tree[1]) + "]"
        )
    if kind == "cat":
        return "".join(render(item) for item in tree[1])
    if kind == "alt":
        return "(?:" + "|".join(render(option) for option in tree[1]) + ")"
    if kind == "rep":
        high = "" if tree[3] is None else tree[3]
        return f"(?:{render(tree[1])}){{{tree[2]},{high}}}"
    raise ValueError(f"cannot render a {kind!r} node")


def _char(code: int) -> str:  # a code point as a character class writes it
    return f"\\u{code:04x}" if code <= 0xFFFF else chr(code)


def compile_regex(pattern: str) -> DFA:
    """``pattern`` as a :class:`DFA` over UTF-8 bytes (ValueError where it is unsupported)."""
    return compile_tree(parse_regex(pattern), f"regex {shown(pattern)}")
