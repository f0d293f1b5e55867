"""The server's extra sampling options (vLLM's): ``allowed_token_ids``, ``bad_words`` and
``truncate_prompt_tokens`` reach the engine; their bad values get 400s in test_errors."""

from __future__ import annotations

from specdec import SamplingParams
from tests.tiny import byte_tokenizer

from .conftest import MODEL


def test_allowed_token_ids_and_bad_words_reach_the_engine(served):
    a, b = byte_tokenizer().decode([65]), byte_tokenizer().decode([66])
    out = served.client().completions.create(
        model=MODEL, prompt="abc", max_tokens=6, temperature=0,
        extra_body={"allowed_token_ids": [65, 66], "bad_words": [a]},
    )  # fmt: skip
    assert out.choices[0].text == b * 6


def test_truncate_prompt_tokens_keeps_the_last_tokens(served, offline):
    long = "y" * 5000  # past the length the server refuses untokenized
    body = {"prompt": long + "abc", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    out = served.post("/v1/completions", json={**body, "truncate_prompt_tokens": 6}).json()
    assert out["usage"]["prompt_tokens"] == 6
    kept = offline.encode(long + "abc")[-6:]
    expected = offline.generate(
        [kept], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    )
    assert out["choices"][0]["text"] == expected[0].text
    echoed = {**body, "truncate_prompt_tokens": 6, "echo": True, "max_tokens": 1}
    assert (
        served.post("/v1/completions", json=echoed)
        .json()["choices"][0]["text"]
        .startswith(offline.decode(kept))
    )
    chat = {"messages": [{"role": "user", "content": long}], "truncate_prompt_tokens": -1}
    usage = served.post("/v1/chat/completions", json=chat).json()["usage"]  # room for one token
    assert usage["prompt_tokens"] == served.llm.engine.max_model_len - 1  # type: ignore[attr-defined]
    assert usage["completion_tokens"] == 1
