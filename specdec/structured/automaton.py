"""Automata over bytes: a syntax tree (:func:`specdec.structured.regex.parse_regex`'s nodes) as
a Thompson NFA whose character sets are UTF-8 byte ranges, then a dense DFA by subset
construction (:func:`compile_tree`), for the guides of :mod:`specdec.structured.guide`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from specdec.structured.utf8 import utf8_ranges

MAX_STATES = 10_000  # DFA states before a pattern is refused (about 3 s of compiling)
MAX_NFA_STATES = 100_000  # NFA states (repetitions expand: (a{100}){100} has 10,000)
MAX_SECONDS = 10.0  # compile time before a pattern is refused
DEAD = 0  # the DFA state no match can leave


class TooLarge(ValueError):
    """A pattern past the limits above (states, time): valid, but too large to follow."""


@dataclass(slots=True)
class _NFA:
    eps: list[list[int]]  # state -> epsilon successors
    edges: list[list[tuple[int, int]]]  # state -> (256-bit byte mask, successor)
    calls: list[list[tuple[int, int]]]  # state -> (rule called, state it returns to)

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise TooLarge(f"regex needs more than {MAX_NFA_STATES} automaton states")
        self.eps.append([])
        self.edges.append([])
        self.calls.append([])
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
    if kind == "call":  # a rule's own automaton reads it (see DFA.calls), then this goes on
        end = nfa.state()
        nfa.calls[start].append((node[1], end))
        return end
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
    prefixes = sorted({b"", *(w[:k] for w in words for k in range(len(w)))}, key=len)
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


def derives(trees: list[tuple], leaf: Callable[[tuple], bool]) -> Callable[[tuple], bool]:
    """Whether a node of ``trees`` (a guide's rules; ``("call", n)`` is rule n) derives a string
    of some kind: ``leaf`` says it of a character set or free text, a sequence does where all
    its parts do, an alternative where one does, a repetition where it may be empty or its item
    does; calls followed, the rules that do found until none is added."""
    done: set[int] = set()

    def holds(node: tuple) -> bool:
        kind = node[0]
        if kind == "call":
            return node[1] in done
        if kind in ("cat", "alt"):
            test = all if kind == "cat" else any
            return test(holds(n) for n in node[1])
        if kind == "rep":
            return node[2] == 0 or holds(node[1])
        return leaf(node)

    while more := {i for i, tree in enumerate(trees) if i not in done and holds(tree)}:
        done |= more
    return holds


def ending(trees: list[tuple]) -> set[int]:
    """Which of ``trees`` (a guide's rules, the first its whole output's) match some string (a
    rule whose every way through calls one that never ends, as ``{"$ref": "#"}`` does, is not
    among them)."""
    ends = derives(trees, lambda node: node[0] != "set" or bool(node[1]))  # (or free text)
    return {i for i, tree in enumerate(trees) if ends(tree)}


@dataclass(slots=True)
class DFA:
    """``table[s, b]``: the state after byte ``b`` from state ``s``; :data:`DEAD` (0) is the
    state from which nothing matches, and every state that cannot reach a match is folded into
    it. ``accepting[s]``: whether the bytes read so far match in full. Start: state 1.
    ``calls[s]``: where a tree's ``("call", rule)`` nodes are (a grammar's recursion, see
    :mod:`specdec.structured.pushdown`), the rules that may be read from ``s``, each with the
    state to go on from after it; none in a pattern's DFA. ``counts``: a :func:`counter`'s
    (low, high), whose state ``1 + c`` is c readings done."""

    table: np.ndarray  # [S, 256] int32
    accepting: np.ndarray  # [S] bool
    start: int = 1
    calls: Mapping[int, list[tuple[int, int]]] = field(default_factory=dict)
    counts: tuple[int, int | None] | None = None

    def walk(self, state: int, data: bytes) -> int:
        for byte in data:
            state = int(self.table[state, byte])
            if state == DEAD:
                break
        return state

    def fullmatch(self, text: str) -> bool:
        return bool(self.accepting[self.walk(self.start, text.encode())])


def compile_tree(tree: tuple, name: str) -> DFA:
    """A syntax tree (:func:`parse_regex`'s nodes, ``("avoid", words)`` and ``("call", rule)``)
    as a :class:`DFA`; ``name`` says what it is in a :class:`TooLarge` error."""
    deadline = time.monotonic() + MAX_SECONDS
    nfa = _NFA([], [], [])
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
    calls: dict[int, list[tuple[int, int]]] = {}

    def state_of(target: frozenset[int]) -> int:
        if target not in ids:
            if len(ids) >= MAX_STATES:
                raise TooLarge(f"{name} needs more than {MAX_STATES} states")
            ids[target] = len(ids)
            rows.append(np.zeros(256, np.int32))
            todo.append(target)
        return ids[target]

    todo: list[frozenset[int]] = []
    state_of(closure({start}))
    while todo:
        current = todo.pop()
        if time.monotonic() > deadline:
            raise TooLarge(f"{name} takes over {MAX_SECONDS:.0f} s to compile")
        at = ids[current]
        for rule, back in sorted({c for s in current for c in nfa.calls[s]}):
            calls.setdefault(at, []).append((rule, state_of(closure({back}))))
        edges = [e for s in current for e in nfa.edges[s]]
        if not edges:
            continue
        member = np.stack([_bits(mask) for mask, _ in edges])  # [edges, 256]
        signatures, inverse = np.unique(member.T, axis=0, return_inverse=True)
        for k, signature in enumerate(signatures):
            target = state_of(closure({edges[e][1] for e in np.flatnonzero(signature)}))
            rows[at][inverse.reshape(-1) == k] = target
    table = np.stack(rows)
    accepting = np.zeros(len(ids), bool)
    for states, i in ids.items():
        accepting[i] = final in states
    live = _live(table, accepting, calls)
    calls = {s: [(r, b) for r, b in c if live[b]] for s, c in calls.items() if live[s]}
    table = np.where(live[table], table, DEAD).astype(np.int32)
    return DFA(table, accepting, calls={s: c for s, c in calls.items() if c})


def counter(rule: int, low: int, high: int | None) -> DFA:
    """Rule ``rule`` read ``low`` to ``high`` times (None: no most), the count kept in the state
    rather than the pattern unrolled (see :mod:`specdec.structured.counted`): an automaton
    that reads no byte itself, whose state ``1 + c`` (c readings done) calls the rule to go on
    to ``1 + c + 1``, and accepts from ``low`` readings on."""
    last = low if high is None else high  # the state with no most loops on itself
    size = last + 2
    table = np.broadcast_to(np.zeros(256, np.int32), (size, 256))  # no byte leaves a state
    accepting = np.zeros(size, bool)
    accepting[1 + low :] = True
    calls = _CounterCalls(rule, last, high is None)
    return DFA(table, accepting, calls=calls, counts=(low, high))


class _CounterCalls(Mapping[int, list[tuple[int, int]]]):
    """A :func:`counter`'s calls, made when asked for (a bound may be 100,000)."""

    def __init__(self, rule: int, last: int, loops: bool):
        self.rule, self.last, self.states = rule, last, last + loops  # states 1 .. states call

    def __getitem__(self, state: int) -> list[tuple[int, int]]:
        if not 1 <= state <= self.states:
            raise KeyError(state)
        return [(self.rule, 2 + min(state - 1, self.last - 1))]

    def __iter__(self) -> Iterator[int]:
        return iter(range(1, self.states + 1))

    def __len__(self) -> int:
        return self.states


def _live(table: np.ndarray, accepting: np.ndarray, calls: dict[int, list]) -> np.ndarray:
    """The states that can reach a match (through a call too: a rule's language is not empty);
    every transition into another is sent to DEAD."""
    live = accepting.copy()
    while True:
        grown = live | live[table].any(axis=1)
        for s, called in calls.items():
            grown[s] |= any(live[back] for _, back in called)
        grown[DEAD] = False
        if (grown == live).all():
            return live
        live = grown
