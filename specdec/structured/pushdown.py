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

Which tokens may follow (:meth:`PushdownGuide.allowed`) is found for all tokens at once, as
:class:`~specdec.structured.guide.RegexGuide` does: each configuration's automaton reads every
token's bytes in step with numpy, and where the tokens still alive reach a state that may call
or return, those tokens go on, from the next byte, in each configuration that call or return
leads to (a smaller walk, recursively), so a token that closes three brackets and opens one is
followed exactly. Masks are kept per guide state (least recently used out).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from specdec.structured.automaton import DEAD, DFA
from specdec.structured.masks import Masks

MASKS_KEPT = 1024  # guide states whose masks are kept
MAX_STACK = 1_000  # return points a configuration may hold (nesting past it is not followed)
MAX_CALLS = 64  # calls in a row without a byte read (left recursion through other rules)

Config = tuple[tuple[tuple[int, int], ...], int, int]  # (return points, automaton, state)


class PushdownGuide:
    """The output is a string the patterns' root (``dfas[0]``) derives, calls followed."""

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
        return self._closure({((), 0, self.dfas[0].start)})

    def advance(self, state: frozenset[Config], token: int) -> frozenset[Config] | None:
        spelled = self.vocabulary.spelled[token] if token < self.vocabulary.size else b""
        if not spelled:  # an end-of-sequence id ends the output; other specials, free text only
            free = frozenset(c for c in state if self._free(c))
            return free if free and bool(self.unspelled[token]) else None
        for byte in spelled:
            moved = set()
            for stack, d, s in state:
                t = int(self.dfas[d].table[s, byte])
                if t != DEAD:
                    moved.add((stack, d, t))
            if not moved:
                return None
            state = self._closure(moved)
        return state

    def allowed(self, state: frozenset[Config]) -> torch.Tensor:
        mask = self.masks.get(state, self._mask)
        return mask | self.unspelled if any(self._free(c) for c in state) else mask

    def _free(self, config: Config) -> bool:
        stack, d, s = config
        return not stack and d == 0 and bool(self.free[s])

    def _mask(self, state: frozenset[Config]) -> np.ndarray:
        v = self.vocabulary
        ok = np.zeros(len(v.ids), bool)
        rows = np.arange(len(v.ids))
        for config in state:
            ok |= self._walk(config, rows, 0)
        mask = np.zeros(v.size, bool)
        mask[v.ids[ok]] = True
        ends = any(not stack and self.dfas[d].accepting[s] for stack, d, s in state)
        if ends or not mask.any():  # a whole derivation may end; a dead end ends, not stalls
            mask[v.eos_token_ids] = True
        return mask

    def _walk(self, config: Config, rows: np.ndarray, k: int) -> np.ndarray:
        """Whether each token of ``rows`` (the vocabulary's, every one longer than ``k``
        bytes) can be read from its byte ``k`` on, starting in ``config``."""
        v = self.vocabulary
        stack, d, state = config
        table, accepting, calling = self.dfas[d].table, self.dfas[d].accepting, self.calling[d]
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
            branching = calling[at[live]] | (accepting[at[live]] & bool(stack))
            branch = live[branching]
            for s in np.unique(at[branch]).tolist():
                sub = branch[at[branch] == s]
                for moved in self._moves((stack, d, s)):
                    ok[sub] |= self._walk(moved, rows[sub], j)
        return ok

    def _moves(self, config: Config) -> frozenset[Config]:
        """The configurations ``config`` reaches by calls and returns alone (kept)."""
        moves = self.moves.get(config)
        if moves is None:
            moves = self.moves[config] = self._closure({config}) - {config}
            if len(self.moves) > MASKS_KEPT:
                self.moves.popitem(last=False)
        return moves

    def _closure(self, configs: set[Config]) -> frozenset[Config]:
        """``configs`` and every configuration they reach by calls and returns, no byte read."""
        seen = set(configs)
        todo = [(c, 0) for c in configs]
        while todo:
            (stack, d, s), calls = todo.pop()
            dfa, reached = self.dfas[d], []
            if calls < MAX_CALLS and len(stack) < MAX_STACK:
                for rule, back in dfa.calls.get(s, ()):
                    called = (*stack, (d, back))
                    reached.append(((called, rule, self.dfas[rule].start), calls + 1))
            if stack and dfa.accepting[s]:
                reached.append(((stack[:-1], *stack[-1]), calls))
            for config, made in reached:
                if config not in seen:
                    seen.add(config)
                    todo.append((config, made))
        return frozenset(seen)
