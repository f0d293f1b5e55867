"""Output text, stop strings and streaming deltas.

The whole output is decoded again each step (cheap next to a forward pass, and always equal to
what one final decode gives). A stop string ends the request: the tokens up to the one that
completed it are kept, the text stops just before it. While a request runs, a delta holds back
text that might still become a stop string, and an incomplete UTF-8 character.
"""

from __future__ import annotations

from specdec.scheduler import Scheduler
from specdec.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):  # noqa: ANN001 - a transformers tokenizer
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def step(self, seq: Sequence, scheduler: Scheduler) -> str:
        """Update ``seq.output_text``, finishing ``seq`` on a stop string; return the new text."""
        text = self.decode(seq.output_token_ids)
        stops = seq.params.stop
        if stops and not seq.is_finished:
            text = self._cut_at_stop(seq, text, scheduler)
        if not seq.is_finished:
            text = text[: len(text) - _held_back(text, stops)]
        delta = text[len(seq.output_text) :] if text.startswith(seq.output_text) else ""
        seq.output_text += delta
        return delta

    def _cut_at_stop(self, seq: Sequence, text: str, scheduler: Scheduler) -> str:
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, len(seq.output_text) - longest)
        hits = [i for i in (text.find(s, start) for s in seq.params.stop) if i >= 0]
        if not hits:
            return text
        cut = min(hits)
        # Keep the fewest output tokens whose text already reaches past the stop string's start.
        num_tokens = seq.num_output_tokens
        while num_tokens > 1 and len(self.decode(seq.output_token_ids[: num_tokens - 1])) > cut:
            num_tokens -= 1
        scheduler.finish(seq, "stop", num_output_tokens=num_tokens)
        return text[:cut]


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` to withhold from a stream for now."""
    if text.endswith("\ufffd"):  # an incomplete multi-byte character
        return len(text) - len(text.rstrip("\ufffd"))
    held = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held
