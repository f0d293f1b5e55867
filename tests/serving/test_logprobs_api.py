"""Logprobs through the API, in the shapes the `openai` client parses, as offline generate gives."""

from __future__ import annotations

import pytest

from specdec import SamplingParams
from specdec.serving import ServerConfig
from tests.tiny import byte_tokenizer

from .conftest import MODEL

CHAT = [{"role": "user", "content": "Name a prime."}]
EXTRA = {"ignore_eos": True}


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


def test_echo_starts_each_choice_with_its_prompt(served, offline):
    client = served.client()
    ids = offline.encode("tokens")
    args = dict(model=MODEL, max_tokens=6, temperature=0, extra_body=EXTRA)
    plain = client.completions.create(prompt=["Once", ids], n=2, **args)
    echoed = client.completions.create(prompt=["Once", ids], n=2, echo=True, **args)
    for i, (p, e) in enumerate(zip(plain.choices, echoed.choices)):
        assert e.text == ("Once" if i < 2 else "tokens") + p.text
        assert e.logprobs is None
    assert echoed.usage == plain.usage  # the echoed prompt is not generated text


def test_echo_with_logprobs_scores_the_prompt_then_the_output(served, offline):
    prompt = "Once upon a"
    out = served.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True,
        extra_body=EXTRA,
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2
    )
    expected = offline.generate(prompt, params)
    prompt_ids, first = offline.encode(prompt), expected[0]
    assert first.prompt_logprobs is not None and first.logprobs is not None
    logprobs = out.choices[0].logprobs
    token_ids = prompt_ids + first.token_ids
    texts = [byte_tokenizer().decode([t]) for t in token_ids]
    assert out.choices[0].text == prompt + first.text
    assert logprobs.tokens == texts
    assert logprobs.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    scored = [lp.logprob for lp in first.prompt_logprobs[1:] + first.logprobs]
    assert logprobs.token_logprobs[1:] == pytest.approx(scored)
    for text, top, lp in zip(texts[1:], logprobs.top_logprobs[1:], first.prompt_logprobs[1:]):
        assert top[text] == pytest.approx(lp.logprob)


def test_loglikelihood_as_evaluation_harnesses_ask_for_it(served, offline):
    """lm-evaluation-harness scores a continuation through completions: token ids of context +
    continuation, echo, logprobs=1, max_tokens=1; the continuation's logprobs are
    token_logprobs[len(context):-1], and it is greedy where each is its position's top token."""
    context, continuation = offline.encode("The cat sat on"), offline.encode(" the mat")
    out = served.client().completions.create(
        model=MODEL, prompt=context + continuation, max_tokens=1, temperature=0, logprobs=1,
        echo=True,
    )  # fmt: skip
    lps = out.choices[0].logprobs
    assert len(lps.tokens) == len(context) + len(continuation) + 1
    scored = offline.generate(
        context + continuation, SamplingParams(max_tokens=1, prompt_logprobs=1)
    )[0].prompt_logprobs
    assert scored is not None
    expected = [lp.logprob for lp in scored[len(context) :]]
    assert lps.token_logprobs[len(context) : -1] == pytest.approx(expected)
    greedy = [max(top, key=top.get) == token for token, top in zip(lps.tokens, lps.top_logprobs)
              if top is not None]  # fmt: skip
    ranks = [lp.rank == 1 for lp in scored[1:]]
    assert greedy[: len(ranks)] == ranks


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(served, offline):
    client = served.client()
    for stream in (False, True):
        args = dict(model=MODEL, prompt="abcde", max_tokens=0, echo=True, logprobs=0)
        if stream:
            chunks = list(client.completions.create(stream=True, **args))
            text = "".join(c.choices[0].text for c in chunks)
            tokens = [
                t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
            ]
            reason = chunks[-1].choices[0].finish_reason
        else:
            out = client.completions.create(**args)
            text, tokens = out.choices[0].text, out.choices[0].logprobs.tokens
            reason = out.choices[0].finish_reason
            assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == 5
        assert text == "abcde" and tokens == list("abcde") and reason == "length"
    refused = served.post("/v1/completions", json={"prompt": "abc", "max_tokens": 0})
    assert refused.status_code == 400 and "only with echo" in refused.text


def test_streamed_echo_adds_up_to_the_full_response(served):
    client = served.client()
    args = dict(model=MODEL, prompt="stream me", max_tokens=12, temperature=0, echo=True,
                logprobs=1, extra_body=EXTRA)  # fmt: skip
    full = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args)]
    assert chunks[0].text.startswith("stream me")
    assert "".join(c.text for c in chunks) == full.text
    parts = [c.logprobs for c in chunks if c.logprobs is not None]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in getattr(p, field)] == getattr(full.logprobs, field)


def test_prompt_logprobs_in_vllms_shape(served, offline):
    """vLLM's extra field: per prompt token, None for the first, else token id -> logprob, rank
    and text, for the prompt's token and the most likely ones."""
    body = {"prompt": "Once upon", "max_tokens": 2, "prompt_logprobs": 2}
    choice = served.post("/v1/completions", json=body).json()["choices"][0]
    expected = offline.generate("Once upon", SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    assert expected.prompt_logprobs is not None
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(expected.prompt_logprobs)
    for entry, lp in zip(got[1:], expected.prompt_logprobs[1:]):
        assert lp is not None
        wanted = {lp.token_id: (lp.logprob, lp.rank)} | {
            t: (v, rank) for rank, (t, v) in enumerate(lp.top, start=1) if t != lp.token_id
        }
        assert {int(t) for t in entry} == set(wanted)
        for token, (logprob, rank) in wanted.items():
            e = entry[str(token)]
            assert e["logprob"] == pytest.approx(logprob) and e["rank"] == rank
            assert e["decoded_token"] == byte_tokenizer().decode([token])
    assert choice["logprobs"] is None  # prompt_logprobs alone does not ask for the output's


def test_chat_prompt_logprobs_score_the_templated_prompt(served, offline):
    body = {"messages": CHAT, "max_tokens": 2, "n": 2, "prompt_logprobs": 0}
    response = served.post("/v1/chat/completions", json=body).json()
    expected = offline.chat(CHAT, SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert expected.prompt_logprobs is not None
    got = response["prompt_logprobs"]  # one list per response, as vLLM's: one prompt
    assert len(got) == len(expected.prompt_logprobs) == len(offline.apply_chat_template(CHAT))
    for entry, lp in zip(got[1:], expected.prompt_logprobs[1:]):
        assert lp is not None and entry[str(lp.token_id)]["logprob"] == pytest.approx(lp.logprob)
    plain = served.post("/v1/chat/completions", json=body | {"prompt_logprobs": None}).json()
    assert plain["prompt_logprobs"] is None


def test_tokens_as_token_ids_name_every_token_by_its_id(served, offline, make_server):
    """vLLM's return_tokens_as_token_ids: in completions, chat, prompt logprobs and streams; the
    server's flag makes it the default, which a request can turn off."""
    client = served.client()
    ids = {"return_tokens_as_token_ids": True, **EXTRA}
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    expected = offline.generate("Once upon", params)[0].logprobs
    assert expected is not None
    named = [f"token_id:{lp.token_id}" for lp in expected]
    out = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=6, temperature=0, logprobs=2, extra_body=ids
    )
    logprobs = out.choices[0].logprobs
    assert logprobs.tokens == named
    assert logprobs.text_offset == [sum(len(t) for t in named[:i]) for i in range(len(named))]
    assert all(
        top[t] == pytest.approx(lp.logprob)
        for t, top, lp in zip(named, logprobs.top_logprobs, expected)
    )
    streamed = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=6, temperature=0, logprobs=0, stream=True,
        extra_body=ids,
    )  # fmt: skip
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == named
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={**ids, "prompt_logprobs": 1},
    )  # fmt: skip
    for entry in chat.choices[0].logprobs.content:
        assert entry.token.startswith("token_id:") and entry.bytes == list(entry.token.encode())
        assert all(t.token.startswith("token_id:") for t in entry.top_logprobs)
    prompt = chat.model_extra["prompt_logprobs"]
    assert all(e["decoded_token"].startswith("token_id:") for p in prompt[1:] for e in p.values())
    by_flag = make_server(ServerConfig(served_model_name=MODEL, return_tokens_as_token_ids=True))
    args = dict(model=MODEL, prompt="Once upon", max_tokens=6, temperature=0, logprobs=0)
    flagged = by_flag.client().completions.create(**args, extra_body=EXTRA)
    assert flagged.choices[0].logprobs.tokens == named
    off = {"return_tokens_as_token_ids": False, **EXTRA}
    texts = by_flag.client().completions.create(**args, extra_body=off).choices[0].logprobs.tokens
    assert texts == [byte_tokenizer().decode([lp.token_id]) for lp in expected]
