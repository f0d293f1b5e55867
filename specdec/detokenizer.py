"""Output text, stop strings and streaming deltas.

Text is decoded incrementally, as vLLM does: each step decodes only the tokens since the last
complete character, beside the tokens of the step before them as context (so a SentencePiece
token's leading space is kept, as in a decode of the whole output), and takes the difference. A
step's cost therefore does not grow with the output: decoding the whole output again each step
took 1.16 s of 25.5 s for 16 requests of 400 tokens under a profiler (0.20 s incrementally), a
share that grows with the length. The text equals
one decode of the whole output for byte-level BPE and SentencePiece-style tokenizers (tested);
it only ever grows, so a tokenizer that tidies spaces across tokens may keep a space that a
whole decode would drop.

A stop string ends the request: the tokens up to the one that completed it are kept, the text
stops just before it (or just after it, with ``include_stop_str_in_output``). An end-of-sequence
token or one of ``stop_token_ids`` that ends it stays in the tokens and, as in vLLM, out of the
text unless ``include_stop_str_in_output``. Stop strings are looked for in the text a step added
(and the longest stop string's length before it). A stop string also wins when the step that
completed it ended the request by length or an end-of-sequence token: the request ends as if its
tokens had arrived one at a time, with ``finish_reason`` "stop". While a request runs, a delta
holds back text that might still become a stop string, and an incomplete UTF-8 character.

transformers' ``stop_strings`` (``SamplingParams.stop_strings``) end the request at the first
token that completes one in the text of the prompt and the output (so one may begin in the
prompt), and keep it, in the tokens and the text, as ``StopStringCriteria`` stops ``generate``.
"""

from __future__ import annotations

from specdec.scheduler import Scheduler
from specdec.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):  # noqa: ANN001 - a transformers tokenizer
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def step(self, seq: Sequence, scheduler: Scheduler) -> str:
        """Update ``seq.output_text``, finishing ``seq`` on a stop string; return the new text."""
        text = self._text(seq)
        stops = seq.params.stop
        if stops and seq.finish_reason != "abort":
            text = self._cut_at_stop(seq, text, scheduler)
        elif seq.params.stop_strings and seq.finish_reason != "abort":
            text = self._end_at_stop_string(seq, text, scheduler)
        if not seq.is_finished:
            text = text[: len(text) - held_back(text, stops)]
        delta = text[len(seq.output_text) :] if text.startswith(seq.output_text) else ""
        seq.output_text += delta
        return delta

    def _text(self, seq: Sequence) -> str:
        """The whole output's text, decoding only the tokens since the last complete character
        (the context tokens before them decode twice, once to be subtracted)."""
        ids, skip = seq.output_token_ids, seq.params.skip_special_tokens
        if ended_by_stop_token(seq) and not seq.params.include_stop_str_in_output:
            ids = ids[:-1]  # as vLLM, the text leaves out the token that ended it
        context = self.decode(ids[seq.prefix_offset : seq.read_offset], skip)
        window = self.decode(ids[seq.prefix_offset :], skip)
        new = window[len(context) :]
        text = seq.decoded_text + new
        if new and not new.endswith("\ufffd"):  # complete characters: settle them
            seq.decoded_text = text
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return text

    def _cut_at_stop(self, seq: Sequence, text: str, scheduler: Scheduler) -> str:
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, len(seq.output_text) - longest)
        hits = [(i, -len(s)) for s in seq.params.stop if (i := text.find(s, start)) >= 0]
        if not hits:
            return text
        at, minus_length = min(hits)  # the first to start; of those, the longest
        # Keep the fewest output tokens whose text reaches past the stop string's start (or
        # holds all of it, when it stays in the text).
        include = seq.params.include_stop_str_in_output
        cut = at - minus_length if include else at
        self._finish_within(seq, cut if include else cut + 1, scheduler)
        return text[:cut]

    def _finish_within(self, seq: Sequence, reach: int, scheduler: Scheduler) -> int:
        """Finish ``seq`` ("stop") keeping the fewest output tokens whose text holds ``reach``
        characters; return how many."""
        num_tokens, ids, skip = (
            seq.num_output_tokens,
            seq.output_token_ids,
            seq.params.skip_special_tokens,
        )
        while num_tokens > 1 and len(self.decode(ids[: num_tokens - 1], skip)) >= reach:
            num_tokens -= 1
        scheduler.finish(seq, "stop", num_output_tokens=num_tokens)
        seq.finish_reason = "stop"  # also when this step's last token ended it by length or EOS
        return num_tokens

    def _end_at_stop_string(self, seq: Sequence, text: str, scheduler: Scheduler) -> str:
        """End ``seq`` at the first output token that completes one of its ``stop_strings``
        (transformers' rule): of the occurrences that end in the text since the last step, the
        one that ends first. The prompt's last tokens' text goes before the output's."""
        strings = seq.params.stop_strings or []
        if seq.stop_context is None:  # a token holds a character or more (or a special token)
            tail = seq.prompt_token_ids[-max(len(s) for s in strings) :]
            seq.stop_context = self.decode(tail, skip_special_tokens=False)
        context = seq.stop_context
        whole, seen = context + text, len(context) + len(seq.output_text)
        ends = [i + len(s) for s in strings if (i := whole.find(s, max(0, seen - len(s) + 1))) >= 0]
        if not ends:
            return text
        before = seq.num_output_tokens
        kept = self._finish_within(seq, min(ends) - len(context), scheduler)
        if kept < before:  # the text of the tokens kept
            return self.decode(seq.output_token_ids, seq.params.skip_special_tokens)
        return text


def ended_by_stop_token(seq: Sequence) -> bool:
    """Whether ``seq`` has just ended on an end-of-sequence token or one of its stop_token_ids."""
    if not (seq.is_finished and seq.finish_reason == "stop" and seq.num_output_tokens):
        return False
    last = seq.token_ids[-1]
    return last in seq.params.stop_token_ids or (
        last in seq.eos_token_ids and not seq.params.ignore_eos
    )


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` to withhold from a stream for now: an incomplete
    character, or the longest end of ``text`` that begins one of ``stops``.

    Only the positions in the last ``len(stop) - 1`` characters where the stop's first character
    occurs are tried, longest first, so a step costs little even with many long stop strings.
    """
    if text.endswith("\ufffd"):  # an incomplete multi-byte character
        return len(text) - len(text.rstrip("\ufffd"))
    held = 0
    for stop in stops:
        i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
        while i >= 0 and len(text) - i > held:
            if stop.startswith(text[i:]):
                held = len(text) - i
                break
            i = text.find(stop[0], i + 1)
    return held
