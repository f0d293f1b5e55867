"""A guide that starts after a text: the output is free until the text first appears, then
follows the guide (``SamplingParams.guide_after``).

vLLM applies a reasoning model's structured output only once its thinking has ended (the
reasoning parser's end tag, ``</think>``), so that the model thinks freely and then answers in
the required form. Here that is one more DFA (:func:`after_text`): a Knuth-Morris-Pratt matcher
for the text, whose states accept anything that does not complete it (the end of the output is
allowed there, as vLLM leaves the thinking unconstrained), joined at the text's last byte to the
guide's DFA. :class:`~specdec.structured.guide.RegexGuide` then indexes it like any pattern's,
so drafts are verified against it with no change to the verifier.
"""

from __future__ import annotations

import numpy as np

from specdec.structured.regex import DEAD, DFA


def after_text(text: bytes, dfa: DFA) -> DFA:
    """A DFA for: any bytes that do not contain ``text``, then ``text``, then what ``dfa``
    accepts. States: 0 dead, ``1 + k`` for ``k`` bytes of ``text`` matched (``k < len(text)``),
    then ``dfa``'s live states, each shifted by ``len(text)``."""
    size = len(text)
    failure = _prefix_function(text)
    inner = dfa.table.shape[0]
    table = np.zeros((size + inner, 256), np.int32)  # [S, 256]
    for k in range(size):
        for byte in range(256):
            matched = _next(text, failure, k, byte)
            table[1 + k, byte] = dfa.start + size if matched == size else 1 + matched
    table[size + 1 :] = np.where(dfa.table[1:] == DEAD, DEAD, dfa.table[1:] + size)
    accepting = np.zeros(size + inner, bool)  # [S]
    accepting[1 : size + 1] = True  # the output may end before the text (free until it)
    accepting[size + 1 :] = dfa.accepting[1:]
    return DFA(table, accepting, start=1)


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
