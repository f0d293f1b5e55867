"""Regular expressions compiled to a DFA over UTF-8 bytes, for guided decoding.

The model emits tokens, each a few bytes that may split a character, so a pattern becomes an
automaton over bytes: parsed (:class:`_Parser`, Python's ``re`` syntax in part), a Thompson NFA
whose character sets are spelled as UTF-8 byte ranges (:func:`~specdec.structured.utf8.utf8_ranges`, after RE2's
construction), then a dense DFA by subset construction (:func:`compile_regex`). Outlines (Willard
and Louf 2023) and vLLM index a vocabulary against such an automaton, as
:mod:`specdec.structured.guide` does.

Supported: literals, ``.`` (not a newline), ``[a-z]``, ``[^...]``, the escapes ``\\d \\w \\s
\\D \\W \\S`` (ASCII, as under ``re.ASCII`` and in JSON Schema), ``\\n \\t \\r \\f \\v``,
``\\xhh``, ``\\uhhhh`` and escaped metacharacters, ``(...)``, ``(?:...)``, ``|``, and ``* + ? {n} {n,} {,m} {n,m}``
(lazy forms too); ``^`` and ``$`` at the ends only (a match is always whole). Backreferences,
lookarounds, flags and patterns past the limits below are refused with a ValueError.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from specdec.structured.utf8 import utf8_ranges

MAX_CODEPOINT = 0x10FFFF
MAX_STATES = 10_000  # DFA states before a pattern is refused (about 3 s of compiling)
MAX_NFA_STATES = 100_000  # NFA states (repetitions expand: (a{100}){100} has 10,000)
MAX_SECONDS = 10.0  # compile time before a pattern is refused
MAX_REPEAT = 1_000  # the largest {n,m} bound
MAX_NESTING = 100  # groups within groups
DEAD = 0  # the DFA state no match can leave

Ranges = list[tuple[int, int]]  # sorted, disjoint, inclusive code point ranges

DIGIT: Ranges = [(0x30, 0x39)]
WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20)]
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
CLASSES = {"d": DIGIT, "w": WORD, "s": SPACE}


class TooLarge(ValueError):
    """A pattern past the limits above (states, time): valid, but too large to follow."""


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

    def __init__(self, pattern: str):
        self.p, self.i, self.depth = pattern, 0, 0

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


@dataclass(slots=True)
class _NFA:
    eps: list[list[int]]  # state -> epsilon successors
    edges: list[list[tuple[int, int]]]  # state -> (256-bit byte mask, successor)

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise TooLarge(f"regex needs more than {MAX_NFA_STATES} automaton states")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1


def _mask(lo: int, hi: int) -> int:
    return ((1 << (hi - lo + 1)) - 1) << lo


def _bits(mask: int) -> np.ndarray:
    raw = np.frombuffer(mask.to_bytes(32, "little"), np.uint8)
    return np.unpackbits(raw, bitorder="little").astype(bool)


def _build(nfa: _NFA, node: tuple, start: int) -> int:
    """Add ``node`` to ``nfa`` from ``start``; return its end state."""
    kind = node[0]
    if kind == "avoid":
        return _avoid(nfa, node[1], start)
    if kind == "set":
        end = nfa.state()
        for lo, hi in node[1]:
            for seq in utf8_ranges(lo, hi):
                at = start
                for k, (a, b) in enumerate(seq):
                    nxt = end if k == len(seq) - 1 else nfa.state()
                    nfa.edges[at].append((_mask(a, b), nxt))
                    at = nxt
        return end
    if kind == "cat":
        for item in node[1]:
            start = _build(nfa, item, start)
        return start
    if kind == "alt":
        end = nfa.state()
        for option in node[1]:
            nfa.eps[_build(nfa, option, start)].append(end)
        return end
    _, inner, low, high = node
    for _ in range(low):
        start = _build(nfa, inner, start)
    if high is None:  # a loop: start -> inner -> start
        loop = nfa.state()
        nfa.eps[start].append(loop)
        nfa.eps[_build(nfa, inner, loop)].append(loop)
        return loop
    end = nfa.state()
    for _ in range(high - low):
        nfa.eps[start].append(end)
        start = _build(nfa, inner, start)
    nfa.eps[start].append(end)
    return end


def _avoid(nfa: _NFA, words: tuple[bytes, ...], start: int) -> int:
    """Any bytes in which none of ``words`` occurs (the tree node ``("avoid", words)``, which
    no pattern spells): Aho and Corasick's automaton of the words (1975), a state per longest
    suffix read that begins a word, less the transitions that complete one; any state may end.
    """
    prefixes = sorted({w[:k] for w in words for k in range(len(w))}, key=len)
    state = {p: nfa.state() for p in prefixes}  # b"" (nothing begun) first
    nfa.eps[start].append(state[b""])
    end = nfa.state()
    alphabet = sorted({b for w in words for b in w})
    other = (1 << 256) - 1 - sum(1 << b for b in alphabet)  # bytes no word holds: back to b""
    for prefix, at in state.items():
        nfa.eps[at].append(end)
        nfa.edges[at].append((other, state[b""]))
        for byte in alphabet:
            read = prefix + bytes([byte])
            if not any(read.endswith(w) for w in words):
                longest = next(read[k:] for k in range(len(read) + 1) if read[k:] in state)
                nfa.edges[at].append((1 << byte, state[longest]))
    return end


@dataclass(slots=True)
class DFA:
    """``table[s, b]``: the state after byte ``b`` from state ``s``; :data:`DEAD` (0) is the
    state from which nothing matches, and every state that cannot reach a match is folded into
    it. ``accepting[s]``: whether the bytes read so far match in full. Start: state 1."""

    table: np.ndarray  # [S, 256] int32
    accepting: np.ndarray  # [S] bool
    start: int = 1

    def walk(self, state: int, data: bytes) -> int:
        for byte in data:
            state = int(self.table[state, byte])
            if state == DEAD:
                break
        return state

    def fullmatch(self, text: str) -> bool:
        return bool(self.accepting[self.walk(self.start, text.encode())])


def parse_regex(pattern: str) -> tuple:
    """``pattern``'s syntax tree, as :func:`compile_tree` takes it (ValueError if unsupported)."""
    return _Parser(pattern).parse()


def compile_regex(pattern: str) -> DFA:
    """``pattern`` as a :class:`DFA` over UTF-8 bytes (ValueError where it is unsupported)."""
    return compile_tree(parse_regex(pattern), f"regex {shown(pattern)}")


def compile_tree(tree: tuple, name: str) -> DFA:
    """A syntax tree (:func:`parse_regex`'s nodes, and ``("avoid", words)``) as a :class:`DFA`;
    ``name`` says what it is in a :class:`TooLarge` error."""
    deadline = time.monotonic() + MAX_SECONDS
    nfa = _NFA([], [])
    start = nfa.state()
    final = _build(nfa, tree, start)

    def closure(states: set[int]) -> frozenset[int]:
        stack, seen = list(states), set(states)
        while stack:
            for t in nfa.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)

    ids: dict[frozenset[int], int] = {frozenset(): DEAD}
    rows: list[np.ndarray] = [np.zeros(256, np.int32)]
    first = closure({start})
    ids[first], todo = 1, [first]
    rows.append(np.zeros(256, np.int32))
    while todo:
        current = todo.pop()
        if time.monotonic() > deadline:
            raise TooLarge(f"{name} takes over {MAX_SECONDS:.0f} s to compile")
        edges = [e for s in current for e in nfa.edges[s]]
        if not edges:
            continue
        member = np.stack([_bits(mask) for mask, _ in edges])  # [edges, 256]
        signatures, inverse = np.unique(member.T, axis=0, return_inverse=True)
        row = rows[ids[current]]
        for k, signature in enumerate(signatures):
            target = closure({edges[e][1] for e in np.flatnonzero(signature)})
            if target not in ids:
                if len(ids) >= MAX_STATES:
                    raise TooLarge(f"{name} needs more than {MAX_STATES} states")
                ids[target] = len(ids)
                rows.append(np.zeros(256, np.int32))
                todo.append(target)
            row[inverse.reshape(-1) == k] = ids[target]
    table = np.stack(rows)
    accepting = np.zeros(len(ids), bool)
    for states, i in ids.items():
        accepting[i] = final in states
    return DFA(_prune(table, accepting), accepting)


def _prune(table: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """``table`` with every transition into a state that cannot reach a match sent to DEAD."""
    live = accepting.copy()
    while True:
        grown = live | live[table].any(axis=1)
        grown[DEAD] = False
        if (grown == live).all():
            break
        live = grown
    return np.where(live[table], table, DEAD).astype(np.int32)
