"""A guide for grammars whose recursion is not a loop (nested brackets, expressions within
statements within expressions): a pushdown automaton over bytes, so that nesting is followed
as deep as the output goes, not to a bound.

The grammar is written as patterns that call each other
(:func:`~specdec.structured.grammar.grammar_rules`): each compiles to a byte DFA
(:mod:`specdec.structured.automaton`) whose ``calls`` say where another pattern may be read
before it goes on. A parse is a *configuration*: the automaton and state it is in, and the
stack of (automaton, state) points to return to; where a state may call a pattern, the
configuration also goes into that pattern's start with the return point pushed, and where a
called pattern may end (an accepting state) it also returns, popping. A guide state is the set
of configurations the output so far can be in (closed under those calls and returns: a grammar
may be ambiguous), as a recursive transition network is run (Woods 1970; XGrammar's pushdown
automaton is one).

An ambiguous grammar can be in exponentially many configurations: after n letters of
``root ::= "a" root "b" | "a" root | ""``, each of the n open rules may or may not still owe its
``b``, 2^n stacks. So configurations in the same automaton and state are one, with the *set* of
their stacks (:class:`Stacks`), and a set of stacks is shared as a graph: for each return point
that may be on top, the set of stacks below it, equal sets one object (Tomita's graph-structured
stack, 1985, kept as a minimal DAG). A guide state then holds at most one configuration per
automaton state, and its stacks grow with the nesting, not with the parses.

Which tokens may follow (:meth:`PushdownGuide.allowed`) is found for all tokens at once, as
:class:`~specdec.structured.guide.RegexGuide` does: each configuration's automaton reads every
token's bytes in step with numpy, and where the tokens still alive reach a state that may call
or return, those tokens go on, from the next byte, in each configuration that call or return
leads to (a smaller walk, recursively), so a token that closes three brackets and opens one is
followed exactly. Masks are kept per guide state (least recently used out).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from specdec.structured.automaton import DEAD, DFA
from specdec.structured.masks import Masks

MASKS_KEPT = 1024  # guide states whose masks are kept
UNIONS_KEPT = 1 << 16  # unions of two sets of stacks kept
MAX_STACK = 1_000  # return points a stack may hold (nesting past it is not followed)

Point = tuple[int, int]  # (automaton, state): where a called pattern returns to


class Stacks:
    """A set of return stacks: whether it holds the empty one (``empty``), and for each return
    point that may be on top, the set of stacks below it (``tops``). Made only by a
    :class:`StackTable`, which keeps one object per set, so equal sets are identical."""

    __slots__ = ("__weakref__", "depth", "empty", "tops")
    depth: int

    def __init__(self, empty: bool, tops: dict[Point, Stacks]):
        self.empty, self.tops = empty, tops
        self.depth = 1 + max(b.depth for b in tops.values()) if tops else 0  # the longest's


class StackTable:
    """The sets of stacks in use, one object each (those no guide state holds any longer go)."""

    def __init__(self) -> None:
        self.kept: weakref.WeakValueDictionary[Any, Stacks] = weakref.WeakValueDictionary()
        self.unions: OrderedDict[tuple[Stacks, Stacks], Stacks] = OrderedDict()
        self.empty = self.make(True, {})

    def make(self, empty: bool, tops: dict[Point, Stacks]) -> Stacks:
        key = (empty, frozenset(tops.items()))
        stacks = self.kept.get(key)
        if stacks is None:
            stacks = self.kept[key] = Stacks(empty, tops)
        return stacks

    def push(self, point: Point, below: Stacks) -> Stacks:
        return self.make(False, {point: below})

    def union(self, a: Stacks, b: Stacks) -> Stacks:
        """Every stack of ``a`` and of ``b``: the tops of either, a top of both over the union
        of what is below it in each. The unions made are kept (least recently used out): a
        closure meets the same sets again and again."""
        if a is b:
            return a
        done: dict[tuple[Stacks, Stacks], Stacks] = {}
        todo = [(a, b)]
        while todo:  # the unions below first, without recursion: stacks may be deep
            x, y = pair = todo[-1]
            made = self.unions.get(pair)
            if made is not None:
                self.unions.move_to_end(pair)
                done[pair] = made
                todo.pop()
                continue
            both = [(p, x.tops[p], u) for p, u in y.tops.items() if x.tops.get(p, u) is not u]
            missing = [(v, u) for _, v, u in both if (v, u) not in done]
            if missing:
                todo.extend(missing)
                continue
            todo.pop()
            tops = {**y.tops, **x.tops}
            for p, v, u in both:
                tops[p] = done[v, u]
            done[pair] = self.unions[pair] = self.make(x.empty or y.empty, tops)
            if len(self.unions) > UNIONS_KEPT:
                self.unions.popitem(last=False)
        return done[a, b]


Config = tuple[int, int, Stacks]  # (automaton, state, the stacks of return points under it)


class PushdownGuide:
    """The output is a string the patterns' root (``dfas[0]``) derives, calls followed. A guide
    state is a frozenset of configurations, one per (automaton, state) at most."""

    def __init__(
        self,
        dfas: list[DFA],
        vocabulary: Any,  # noqa: ANN401 - a guide.Vocabulary
        free: np.ndarray | None = None,
    ):
        """``free``: the root's states where the output is free (before a text: see
        :mod:`specdec.structured.after`); there a token that spells nothing (a special one, not
        an end-of-sequence id) is allowed too, and leaves the state as it is."""
        self.dfas, self.vocabulary = dfas, vocabulary
        self.free = np.zeros(len(dfas[0].accepting), bool) if free is None else free
        self.unspelled = vocabulary.unspelled  # [V] bool
        self.masks = Masks(vocabulary.size, MASKS_KEPT)
        self.stacks = StackTable()
        self.moves: OrderedDict[Config, frozenset[Config]] = OrderedDict()
        self.calling = []  # per automaton, [S] bool: states that may call a pattern
        for dfa in dfas:
            called = {rule for calls in dfa.calls.values() for rule, _ in calls}
            if not called <= set(range(1, len(dfas))):
                raise ValueError(f"a pattern calls rule {max(called)} of {len(dfas) - 1}")
            calling = np.zeros(len(dfa.accepting), bool)
            calling[list(dfa.calls)] = True
            self.calling.append(calling)

    def start(self) -> frozenset[Config]:
        return self._closure({(0, self.dfas[0].start): self.stacks.empty})

    def advance(self, state: frozenset[Config], token: int) -> frozenset[Config] | None:
        spelled = self.vocabulary.spelled[token] if token < self.vocabulary.size else b""
        if not spelled:  # an end-of-sequence id ends the output; other specials, free text only
            free = {(d, s): self.stacks.empty for d, s, stacks in state if self._free(d, s, stacks)}
            return self._closure(free) if free and bool(self.unspelled[token]) else None
        for byte in spelled:
            moved: dict[Point, Stacks] = {}
            for d, s, stacks in state:
                t = int(self.dfas[d].table[s, byte])
                if t != DEAD:
                    had = moved.get((d, t))
                    moved[d, t] = stacks if had is None else self.stacks.union(had, stacks)
            if not moved:
                return None
            state = self._closure(moved)
        return state

    def allowed(self, state: frozenset[Config]) -> torch.Tensor:
        mask = self.masks.get(state, self._mask)
        return mask | self.unspelled if any(self._free(*c) for c in state) else mask

    def complete(self, state: frozenset[Config]) -> bool:
        """Whether the output read into ``state`` is a whole string of the grammar."""
        return any(stacks.empty and self.dfas[d].accepting[s] for d, s, stacks in state)

    def _free(self, d: int, s: int, stacks: Stacks) -> bool:
        return d == 0 and stacks.empty and bool(self.free[s])

    def _mask(self, state: frozenset[Config]) -> np.ndarray:
        v = self.vocabulary
        ok = np.zeros(len(v.ids), bool)
        rows = np.arange(len(v.ids))
        for config in state:
            ok |= self._walk(config, rows, 0)
        mask = np.zeros(v.size, bool)
        mask[v.ids[ok]] = True
        if (
            self.complete(state) or not mask.any()
        ):  # a whole derivation may end; a dead end ends, not stalls
            mask[v.eos_token_ids] = True
        return mask

    def _walk(self, config: Config, rows: np.ndarray, k: int) -> np.ndarray:
        """Whether each token of ``rows`` (the vocabulary's, every one longer than ``k``
        bytes) can be read from its byte ``k`` on, starting in ``config``."""
        v = self.vocabulary
        d, state, stacks = config
        table, accepting, calling = self.dfas[d].table, self.dfas[d].accepting, self.calling[d]
        returns = bool(stacks.tops)
        lengths = v.lengths[rows]
        ok = np.zeros(len(rows), bool)
        at = np.full(len(rows), state, np.int32)
        live = np.arange(len(rows))
        j = k
        while len(live):
            at[live] = table[at[live], v.matrix[rows[live], j]]
            live = live[at[live] != DEAD]
            j += 1
            ok[live[lengths[live] == j]] = True
            live = live[lengths[live] > j]
            # tokens in a state that may call, or return (with a point to return to), go on
            # from there too
            branching = calling[at[live]] | (accepting[at[live]] & returns)
            branch = live[branching]
            for s in np.unique(at[branch]).tolist():
                sub = branch[at[branch] == s]
                for moved in self._moves((d, s, stacks)):
                    ok[sub] |= self._walk(moved, rows[sub], j)
        return ok

    def _moves(self, config: Config) -> frozenset[Config]:
        """The configurations ``config`` reaches by calls and returns alone (kept)."""
        moves = self.moves.get(config)
        if moves is None:
            d, s, stacks = config
            moves = self.moves[config] = self._closure({(d, s): stacks}) - {config}
            if len(self.moves) > MASKS_KEPT:
                self.moves.popitem(last=False)
        return moves

    def _closure(self, heads: dict[Point, Stacks]) -> frozenset[Config]:
        """``heads`` (a set of stacks per automaton state) and every configuration they reach
        by calls and returns, no byte read, merged per automaton state. A state's stacks are
        followed again whenever they grow, until none does: a push makes them deeper, so calls
        without a byte read in between (left recursion through other rules, which
        :func:`~specdec.structured.grammar.grammar_rules` refuses) stop at ``MAX_STACK``."""
        heads = dict(heads)
        todo = list(heads)
        while todo:
            d, s = point = todo.pop()
            stacks, dfa = heads[point], self.dfas[d]
            reached: list[tuple[Point, Point | None, Stacks]] = []
            if stacks.depth < MAX_STACK:
                for rule, back in dfa.calls.get(s, ()):
                    reached.append(((rule, self.dfas[rule].start), (d, back), stacks))
            if dfa.accepting[s]:
                reached.extend((top, None, below) for top, below in stacks.tops.items())
            for to, push, below in reached:
                grown = below if push is None else self.stacks.push(push, below)
                had = heads.get(to)
                if had is not None:
                    grown = self.stacks.union(had, grown)
                if grown is not had:
                    heads[to] = grown
                    todo.append(to)
        return frozenset((d, s, stacks) for (d, s), stacks in heads.items())
