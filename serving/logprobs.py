"""Logprobs in the shapes of OpenAI's two APIs, from the engine's :class:`TokenLogprobs`.

A token's text is the tokenizer's decoding of that token alone, and its ``bytes`` that text's
UTF-8 encoding, as vLLM reports them: a token holding part of a multi-byte character decodes to
U+FFFD. Completions' ``text_offset`` counts characters of those texts from the choice's first
token, so the offsets of a streamed choice continue from chunk to chunk. An echoed prompt's tokens
come first, the first of them with null logprobs (nothing precedes it), as in OpenAI's and vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specdec.outputs import TokenLogprobs
from specdec.serving.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)


def token_id_text(token_id: int) -> str:
    """A token named by its id, as vLLM's ``return_tokens_as_token_ids`` names it."""
    return f"token_id:{token_id}"


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
    token_ids: list[int],
    logprobs: list[TokenLogprobs | None],
    texts: Callable[[int], str],
    offset: int = 0,
) -> CompletionLogprobs:
    """The tokens' logprobs as a legacy completion's, the first token's text starting at
    ``offset``; a token without logprobs (an echoed prompt's first) gets nulls."""
    tokens = [texts(t) for t in token_ids]
    starts = []
    for token in tokens:
        starts.append(offset)
        offset += len(token)
    top = [
        None
        if lp is None
        else {texts(token_id): value for token_id, value in (*lp.top, (lp.token_id, lp.logprob))}
        for lp in logprobs
    ]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if lp is None else lp.logprob for lp in logprobs],
        top_logprobs=top,
        text_offset=starts,
    )


def text_length(token_ids: list[int], texts: Callable[[int], str]) -> int:
    """Characters the tokens' texts hold: where the next token's ``text_offset`` starts."""
    return sum(len(texts(t)) for t in token_ids)


def chat_logprobs(logprobs: list[TokenLogprobs], texts: Callable[[int], str]) -> ChatLogprobs:
    def entry(token_id: int, value: float) -> TopLogprob:
        text = texts(token_id)
        return TopLogprob(token=text, logprob=value, bytes=list(text.encode("utf-8")))

    content = []
    for lp in logprobs:
        chosen = entry(lp.token_id, lp.logprob)
        top = [entry(token_id, value) for token_id, value in lp.top]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


def prompt_logprobs(
    logprobs: list[TokenLogprobs | None], texts: Callable[[int], str]
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token, its entry and the most likely tokens'."""

    def entries(lp: TokenLogprobs) -> dict[int, PromptLogprob]:
        ranked = {t: (v, rank) for rank, (t, v) in enumerate(lp.top, start=1)}
        ranked[lp.token_id] = (lp.logprob, lp.rank)
        return {
            t: PromptLogprob(logprob=v, rank=r, decoded_token=texts(t))
            for t, (v, r) in ranked.items()
        }

    return [None if lp is None else entries(lp) for lp in logprobs]
