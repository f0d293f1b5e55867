"""Logprobs in the shapes of OpenAI's two APIs, from the engine's :class:`TokenLogprobs`.

A token's text is the tokenizer's decoding of that token alone, and its ``bytes`` that text's
UTF-8 encoding, as vLLM reports them: a token holding part of a multi-byte character decodes to
U+FFFD. Completions' ``text_offset`` counts characters of those texts from the choice's first
token, so the offsets of a streamed choice continue from chunk to chunk.
"""

from __future__ import annotations

from typing import Any

from specdec.outputs import TokenLogprobs
from specdec.serving.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class TokenTexts:
    """Each token id's text, decoded once per server."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # at most one entry per vocabulary id

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


def completion_logprobs(
    logprobs: list[TokenLogprobs], texts: TokenTexts, offset: int = 0
) -> CompletionLogprobs:
    """``logprobs`` as a legacy completion's, its first token's text starting at ``offset``."""
    tokens = [texts(lp.token_id) for lp in logprobs]
    starts = []
    for token in tokens:
        starts.append(offset)
        offset += len(token)
    top = [
        {texts(token_id): value for token_id, value in (*lp.top, (lp.token_id, lp.logprob))}
        for lp in logprobs
    ]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[lp.logprob for lp in logprobs],
        top_logprobs=top,
        text_offset=starts,
    )


def text_length(logprobs: list[TokenLogprobs], texts: TokenTexts) -> int:
    """Characters the tokens' texts hold: where the next token's ``text_offset`` starts."""
    return sum(len(texts(lp.token_id)) for lp in logprobs)


def chat_logprobs(logprobs: list[TokenLogprobs], texts: TokenTexts) -> ChatLogprobs:
    def entry(token_id: int, value: float) -> TopLogprob:
        text = texts(token_id)
        return TopLogprob(token=text, logprob=value, bytes=list(text.encode("utf-8")))

    content = []
    for lp in logprobs:
        chosen = entry(lp.token_id, lp.logprob)
        top = [entry(token_id, value) for token_id, value in lp.top]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)
