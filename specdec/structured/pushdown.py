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
# return points that may be on top of a set of stacks: past it, the first (in point order) are
# kept, the other parses dropped. No grammar we know of comes near it (a point is a call site
# of one rule, still open at one place); a counted repetition that may begin at any of many
# places (``(a|b)*a(a|b){2000}``, 2^2000 states as a DFA) reaches it, and each byte would cost
# the square of its open counts.
MAX_TOPS = 64

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
        if len(tops) > MAX_TOPS:  # the first return points only (see MAX_TOPS)
            tops = {p: tops[p] for p in sorted(tops)[:MAX_TOPS]}
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
        # per automaton, [S] bool: states some byte leaves (a counter's never: no token is
        # walked from them)
        self.reading = [
            np.zeros(len(dfa.accepting), bool) if dfa.counts else (dfa.table != DEAD).any(axis=1)
            for dfa in dfas
        ]
        # counters (see specdec/structured/counted.py): automaton -> the runs of states
        # (counts) among which the count does not change which tokens may follow. A token
        # reads at most ``longest`` bytes, a reading at least one, so from count c a token
        # ends at most ``longest`` readings on: counts that cannot reach ``low`` within a
        # token look alike, and so do counts from ``low`` on that cannot reach ``high``.
        self.zones: dict[int, list[tuple[int, int]]] = {}
        for d, dfa in enumerate(dfas):
            if dfa.counts is not None:
                low, high, longest = *dfa.counts, vocabulary.columns.shape[0]
                top = len(dfa.accepting) - 2 if high is None else high - longest
                runs = [(0, min(low - longest - 1, top)), (low, top)]
                if zones := [(1 + a, 1 + b) for a, b in runs if a < b]:
                    self.zones[d] = zones
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
        mask = self.masks.get(self._plain(state) if self.zones else state, self._mask)
        return mask | self.unspelled if any(self._free(*c) for c in state) else mask

    def complete(self, state: frozenset[Config]) -> bool:
        """Whether the output read into ``state`` is a whole string of the grammar."""
        return any(stacks.empty and self.dfas[d].accepting[s] for d, s, stacks in state)

    def _plain(self, state: frozenset[Config]) -> frozenset[Config]:
        """``state`` with each count within one of its counter's zones (:attr:`zones`) set to
        the zone's first: a state with the same masks, so that a long counted repetition computes
        them once, not once a count."""
        memo: dict[int, Stacks] = {}  # id of a set of stacks -> its plain one

        def point(d: int, s: int) -> Point:
            for first, last in self.zones.get(d, ()):
                if first <= s <= last:
                    return (d, first)
            return (d, s)

        def plain(stacks: Stacks) -> Stacks:
            todo = [stacks]
            while todo:  # the sets below first, without recursion: stacks may be deep
                x = todo[-1]
                missing = [b for b in x.tops.values() if id(b) not in memo]
                if missing:
                    todo.extend(missing)
                    continue
                todo.pop()
                tops: dict[Point, Stacks] = {}
                for p, below in x.tops.items():
                    q, b = point(*p), memo[id(below)]
                    tops[q] = self.stacks.union(tops[q], b) if q in tops else b
                memo[id(x)] = self.stacks.make(x.empty, tops)
            return memo[id(stacks)]

        return frozenset((*point(d, s), plain(stacks)) for d, s, stacks in state)

    def _free(self, d: int, s: int, stacks: Stacks) -> bool:
        return d == 0 and stacks.empty and bool(self.free[s])

    def _mask(self, state: frozenset[Config]) -> np.ndarray:
        v = self.vocabulary
        ok = np.zeros(len(v.ids), bool)
        for config in state:
            if self.reading[config[0]][config[1]]:
                ok |= self._walk_all(config)
        mask = np.zeros(v.size, bool)
        mask[v.ids[ok]] = True
        if (
            self.complete(state) or not mask.any()
        ):  # a whole derivation may end; a dead end ends, not stalls
            mask[v.eos_token_ids] = True
        return mask

    def _walk_all(self, config: Config) -> np.ndarray:
        """Whether each token of the vocabulary can be read from ``config``: as
        :meth:`_walk`, on slices of the vocabulary's tokens (longest first), as
        :class:`~specdec.structured.guide.RegexGuide` walks them."""
        v = self.vocabulary
        d, state, stacks = config
        table, branching = self.dfas[d].table, self._branching(config)
        ok = np.zeros(len(v.ids), bool)
        at = np.full(len(v.ids), state, np.int32)
        later: dict[Config, list[tuple[np.ndarray, np.ndarray]]] = {}
        for k, count in enumerate(v.longer):  # the tokens longer than k bytes read byte k
            at[:count] = table[at[:count], v.columns[k, :count]]
            end = v.longer[k + 1] if k + 1 < len(v.longer) else 0  # [end, count): k + 1 long
            ok[end:count] = at[end:count] != DEAD
            branch = np.flatnonzero(branching[at[:end]])
            if len(branch):
                self._branch(config, at, branch, np.full(len(branch), k + 1), branch, later)
        self._later(later, np.arange(len(v.ids)), ok)
        return ok

    def _walk(self, config: Config, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Whether each token of ``rows`` (the vocabulary's) can be read from its byte ``pos``
        on (each longer than that), starting in ``config``.

        Where tokens reach a state that may call, or return (with a point to return to), they
        go on in each configuration that leads to as well: later, all that go on in one
        configuration (from any byte) in one walk; at once, in this walk, where the state reads
        nothing itself and the configuration differs from this one only in its state (a
        repetition's next reading, its count in the zone where counts look alike)."""
        v = self.vocabulary
        d, state, stacks = config
        table, branching = self.dfas[d].table, self._branching(config)
        lengths = v.lengths[rows]
        ok = np.zeros(len(rows), bool)
        at = np.full(len(rows), state, np.int32)
        pos = pos.copy()
        live = np.arange(len(rows))
        later: dict[Config, list[tuple[np.ndarray, np.ndarray]]] = {}  # config -> (rows, bytes)
        while len(live):
            at[live] = table[at[live], v.columns[pos[live], rows[live]]]
            live = live[at[live] != DEAD]
            pos[live] += 1
            whole = lengths[live] == pos[live]
            ok[live[whole]] = True
            live = live[~whole]
            branch = live[branching[at[live]]]
            if len(branch):
                self._branch(config, at, branch, pos[branch], rows[branch], later)
        self._later(later, rows, ok)
        return ok

    def _branching(self, config: Config) -> np.ndarray:
        """[S] bool: the states of ``config``'s automaton where a walk from it branches: those
        that may call, and where there is a point to return to, those that may end."""
        d, _, stacks = config
        calling = self.calling[d]
        return calling | self.dfas[d].accepting if stacks.tops else calling

    def _branch(
        self,
        config: Config,
        at: np.ndarray,
        branch: np.ndarray,
        pos: np.ndarray,
        tokens: np.ndarray,
        later: dict[Config, list[tuple[np.ndarray, np.ndarray]]],
    ) -> None:
        """The tokens ``branch`` (indices into ``at``; the vocabulary's ``tokens``, each at its
        byte ``pos``) go on in each configuration their state in ``config``'s automaton moves
        to (see :meth:`_walk`); to be walked later, only those whose next byte it reads."""
        d, _, stacks = config
        states = at[branch]
        for s in np.flatnonzero(np.bincount(states)).tolist():
            chosen = states == s
            sub, where = branch[chosen], pos[chosen]
            jump = not self.reading[d][s]  # the tokens here may move on in this walk
            following: np.ndarray | None = None  # each token's next byte
            for moved in self._moves((d, s, stacks)):
                if jump and moved[0] == d and moved[2] is stacks:
                    at[sub], jump = moved[1], False
                elif self.reading[moved[0]][moved[1]]:
                    if following is None:
                        following = self.vocabulary.columns[where, tokens[chosen]]
                    read = self.dfas[moved[0]].table[moved[1], following] != DEAD
                    if read.any():
                        later.setdefault(moved, []).append((sub[read], where[read]))

    def _later(
        self,
        later: dict[Config, list[tuple[np.ndarray, np.ndarray]]],
        rows: np.ndarray,
        ok: np.ndarray,
    ) -> None:
        """Walk the tokens gathered in ``later`` (indices into ``rows``), a walk a
        configuration, and mark those that go through in ``ok``."""
        for moved, parts in later.items():
            sub = np.concatenate([part for part, _ in parts])
            went = self._walk(moved, rows[sub], np.concatenate([at for _, at in parts]))
            ok[sub[went]] = True

    def _moves(self, config: Config) -> frozenset[Config]:
        """The configurations ``config`` reaches by calls and returns alone (kept), counts
        made plain (:meth:`_plain`: a walk reads one token, no more)."""
        moves = self.moves.get(config)
        if moves is None:
            d, s, stacks = config
            moves = self._closure({(d, s): stacks})
            moves = self.moves[config] = (self._plain(moves) if self.zones else moves) - {config}
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
