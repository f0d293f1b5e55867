"""A guide that starts after a text: the output is free until the text first appears, then
follows the guide (``SamplingParams.guide_after``), optionally only where the output opens
with another text (``guide_after_opening``), and is guided from its first token otherwise.

vLLM applies a reasoning model's structured output only once its thinking has ended (the
reasoning parser's end tag, ``</think>``), so that the model thinks freely and then answers in
the required form. Here that is one more DFA (:func:`after_text`): a Knuth-Morris-Pratt matcher
for the text, whose states accept anything that does not complete it (the end of the output is
allowed there, as vLLM leaves the thinking unconstrained), joined at the text's last byte to the
guide's DFA. With an opening (Qwen3 writes its own ``<think>``), that DFA is entered through the
opening's bytes, and its union with the guide's own DFA (the reachable pairs of their states)
takes whichever the output follows. :class:`~specdec.structured.guide.AfterTextGuide` indexes it
like any pattern's, so drafts are verified against it with no change to the verifier.
"""

from __future__ import annotations

import numpy as np

from specdec.structured.regex import DEAD, DFA


def after_text(text: bytes, dfa: DFA, opening: bytes = b"") -> tuple[DFA, np.ndarray]:
    """The DFA of: any bytes that do not contain ``text``, then ``text``, then what ``dfa``
    accepts; with an ``opening``, that entered through ``opening``, or ``dfa`` alone. Also the
    free states ``[S]`` (those before ``text``, where the output is unconstrained)."""
    size, prefix = len(text), len(opening)
    failure = _prefix_function(text)
    inner = dfa.table.shape[0]
    # states: 0 dead, 1 .. prefix the opening's bytes read, then 1 + prefix + k for k bytes of
    # text matched, then dfa's live states, each shifted by prefix + size
    shift = prefix + size
    table = np.zeros((shift + inner, 256), np.int32)  # [S, 256]
    for i, byte in enumerate(opening):
        table[1 + i, byte] = 2 + i
    for k in range(size):
        for byte in range(256):
            matched = _next(text, failure, k, byte)
            table[1 + prefix + k, byte] = (
                dfa.start + shift if matched == size else 1 + prefix + matched
            )
    table[shift + 1 :] = np.where(dfa.table[1:] == DEAD, DEAD, dfa.table[1:] + shift)
    accepting = np.zeros(shift + inner, bool)  # [S]
    accepting[1 + prefix : 1 + shift] = True  # the output may end before the text (free until it)
    accepting[shift + 1 :] = dfa.accepting[1:]
    free = np.zeros(shift + inner, bool)  # [S]
    free[1 + prefix : 1 + shift] = True
    calls = {s + shift: [(r, back + shift) for r, back in c] for s, c in dfa.calls.items()}
    after = DFA(table, accepting, start=1, calls=calls)
    if not opening:
        return after, free
    return _either(after, free, dfa)


def _either(a: DFA, free_a: np.ndarray, b: DFA) -> tuple[DFA, np.ndarray]:
    """A DFA accepting what ``a`` or ``b`` accepts (their reachable pairs of states), and its
    free states: ``a``'s where ``b`` is dead. A call of either (a grammar's rule: see
    :mod:`specdec.structured.pushdown`) returns to that one's state alone."""
    start = (a.start, b.start)
    index = {start: 1}
    pairs, rows = [start], list[np.ndarray]()
    calls: dict[int, list[tuple[int, int]]] = {}

    def pair_of(pair: tuple[int, int]) -> int:
        if pair not in index:
            index[pair] = len(pairs) + 1
            pairs.append(pair)
        return index[pair]

    while len(rows) < len(pairs):
        state_a, state_b = pairs[len(rows)]
        at = len(rows) + 1
        for rule, back in a.calls.get(state_a, []):
            calls.setdefault(at, []).append((rule, pair_of((back, DEAD))))
        for rule, back in b.calls.get(state_b, []):
            calls.setdefault(at, []).append((rule, pair_of((DEAD, back))))
        row = np.zeros(256, np.int32)
        for byte, pair in enumerate(zip(a.table[state_a].tolist(), b.table[state_b].tolist())):
            if pair != (DEAD, DEAD):
                row[byte] = pair_of(pair)
        rows.append(row)
    table = np.vstack([np.zeros((1, 256), np.int32), *rows])  # [S, 256]
    accepting = np.array([False] + [a.accepting[x] or b.accepting[y] for x, y in pairs])
    free = np.array([False] + [bool(free_a[x]) and y == DEAD for x, y in pairs])
    return DFA(table, accepting, start=1, calls=calls), free


def _prefix_function(text: bytes) -> list[int]:
    """``failure[i]``: the length of the longest proper prefix of ``text[: i + 1]`` that is
    also its suffix (Knuth-Morris-Pratt)."""
    failure = [0] * len(text)
    for i in range(1, len(text)):
        k = failure[i - 1]
        while k and text[i] != text[k]:
            k = failure[k - 1]
        failure[i] = k + (text[i] == text[k])
    return failure


def _next(text: bytes, failure: list[int], matched: int, byte: int) -> int:
    """How many bytes of ``text`` are matched after ``byte``, with ``matched`` before it."""
    while matched and text[matched] != byte:
        matched = failure[matched - 1]
    return matched + (text[matched] == byte)
