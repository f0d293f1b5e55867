"""Prompt lookup: draft the tokens that followed the last occurrence of the current suffix.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's n-gram proposer and
transformers' ``prompt_lookup_num_tokens``): when a sequence ends with an n-gram that appeared
earlier in its prompt or output, the tokens that followed that occurrence are a cheap, often
correct guess of what comes next — summaries, edits and grounded answers copy from the prompt.
Longer suffixes are tried first (``max_n`` down to ``min_n``); the most recent match with ``k``
tokens after it wins. The
search is vectorised over the history with numpy: no Python loop over tokens.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdec.sequence import Sequence


class PromptLookupDrafter:
    name = "prompt_lookup"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> None:
        for seq, k in zip(seqs, num_drafts):
            seq.spec_token_ids = lookup(seq.token_ids, k, self.min_n, self.max_n) if k else []

    def draft_probs(self, seqs: list[Sequence]) -> None:
        return None  # deterministic drafts: q is one-hot

    def forget(self, seq: Sequence) -> None:
        pass


def lookup(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier match of the longest suffix n-gram."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        windows = sliding_window_view(tokens[:-1], n)  # [L - n, n]: every earlier n-gram
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            # The latest match that has k tokens after it; else the earliest (the longest tail).
            full = starts[starts + n + k <= len(tokens)]
            follow = int(full[-1] if full.size else starts[0]) + n
            return tokens[follow : follow + k].tolist()
    return []
