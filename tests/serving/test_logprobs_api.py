"""Logprobs through the API, in the shapes the `openai` client parses, as offline generate gives."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from tests.tiny import byte_tokenizer, tiny_model

from .conftest import MODEL

CHAT = [{"role": "user", "content": "Name a prime."}]
EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def offline() -> LLM:
    """The served model (same weights), run offline as the reference."""
    return LLM(tiny_model("llama"), tokenizer=byte_tokenizer(), num_kv_blocks=64)


def test_completion_logprobs_are_offline_generates(served, offline):
    out = served.client().completions.create(
        model=MODEL, prompt="Once upon", max_tokens=10, temperature=0, logprobs=2, extra_body=EXTRA
    )
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)
    expected = offline.generate("Once upon", params)[0].logprobs
    assert expected is not None
    logprobs = out.choices[0].logprobs
    texts = [byte_tokenizer().decode([lp.token_id]) for lp in expected]
    assert logprobs.tokens == texts
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected])
    assert logprobs.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    for text, top, lp in zip(texts, logprobs.top_logprobs, expected):
        assert 1 <= len(top) <= 3  # the two most likely and the chosen token (texts may repeat)
        assert top[text] == pytest.approx(lp.logprob)


def test_chat_logprobs_with_alternatives(served, offline):
    out = served.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3)
    expected = offline.chat(CHAT, params)[0].logprobs
    content = out.choices[0].logprobs.content
    assert len(content) == len(expected) == out.usage.completion_tokens
    for entry, lp in zip(content, expected):
        assert entry.logprob == pytest.approx(lp.logprob)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in lp.top])
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely token


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_logprobs_add_up_to_the_full_response(served, chat):
    client = served.client()
    args = dict(model=MODEL, max_tokens=24, temperature=0, extra_body=EXTRA)
    if chat:
        args |= dict(messages=CHAT, logprobs=True, top_logprobs=1)
        full = client.chat.completions.create(**args).choices[0].logprobs.content
        chunks = client.chat.completions.create(stream=True, **args)
        streamed = [
            e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content
        ]
        assert streamed == full
        return
    args |= dict(prompt="stream me", logprobs=1)
    full = client.completions.create(**args).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in client.completions.create(stream=True, **args)]
    parts = [p for p in parts if p is not None]
    assert len(parts) > 1
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in getattr(p, field)] == getattr(full, field)


def test_no_logprobs_unless_asked(served):
    client = served.client()
    done = client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert done.choices[0].logprobs is None
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
    assert chat.choices[0].logprobs is None
