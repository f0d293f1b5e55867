"""How much a workload's outputs copy from their prompts: the ceiling of any prompt lookup, and a
fixed yardstick (a greedy-verified 3-gram lookup), both computed from plain decoding's outputs."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdec.drafters.prompt_lookup import lookup


def lookup_ceiling(prompt: list[int], output: list[int], k: int, n: int) -> tuple[int, int]:
    """(tokens, target steps) to produce the greedy ``output`` with an *oracle* prompt lookup.

    At every step the oracle drafts, out of every earlier occurrence of the last
    ``n`` tokens, the (at most ``k``-token) continuation that ``output`` accepts
    longest. Each verification step yields its accepted drafts + 1, so no n-gram lookup with
    these settings, however it chooses its match and ``k``, gets more tokens per target step:
    prompt lookup cannot speed decoding up by more than ``tokens / steps`` on this text.
    """
    tokens = np.asarray(prompt + output, dtype=np.int64)
    pos, steps = len(prompt), 0
    j = np.arange(k)
    while pos < len(tokens):
        best = 0
        if pos > n:
            windows = sliding_window_view(tokens[: pos - 1], n)  # n-grams that end before pos
            follow = np.flatnonzero((windows == tokens[pos - n : pos]).all(axis=1)) + n  # [F]
            draft_at = follow[:, None] + j  # [F, k] positions of each candidate's drafts
            target_at = pos + j  # [k]
            valid = (draft_at < pos) & (target_at < len(tokens))  # inside the history / output
            same = valid & (
                tokens[np.minimum(draft_at, pos - 1)]
                == tokens[np.minimum(target_at, len(tokens) - 1)]
            )
            if follow.size:
                best = int(np.cumprod(same, axis=1).sum(axis=1).max())
        pos, steps = pos + best + 1, steps + 1
    return len(output), steps


def reference_lookup(
    prompt: list[int], output: list[int], n: int = 3, k: int = 8
) -> tuple[int, int]:
    """(tokens, target steps) to produce ``output`` with a greedy-verified ``n``-gram lookup that
    drafts ``k`` tokens at every step where the last ``n`` tokens occurred before.

    A yardstick of how much a style's outputs copy from their prompts, independent of the
    drafter's settings and policy: issue #4 expects about 1.8 tokens per step on summarization
    and 2.2 on retrieval-grounded prompts.
    """
    tokens, steps, pos = prompt + output, 0, 0
    while pos < len(output):
        drafts = lookup(tokens[: len(prompt) + pos], k, n, n)
        accepted = 0
        while (
            accepted < len(drafts)
            and pos + accepted < len(output) - 1  # the last token comes from a step of its own
            and drafts[accepted] == output[pos + accepted]
        ):
            accepted += 1
        pos, steps = pos + accepted + 1, steps + 1
    return len(output), steps
