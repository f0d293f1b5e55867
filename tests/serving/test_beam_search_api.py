"""``use_beam_search`` (vLLM's extra field): the server's beams are ``LLM.beam_search``'s, each
step run through the engine thread beside other requests, at a temperature too; a stream sends
each choice whole; what a search cannot honour is a 400, and a client that leaves mid-search
leaves nothing behind."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from specdec import BeamSearchParams, SamplingParams

from .conftest import MODEL

CHAT = [{"role": "user", "content": "Name a prime."}]


def test_completion_beams_equal_offline_beam_search(served, offline):
    body = {
        "model": MODEL, "prompt": ["Once upon a time", "The sea"], "max_tokens": 10, "n": 3,
        "use_beam_search": True, "length_penalty": 0.5, "early_stopping": True,
    }  # fmt: skip
    response = served.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    params = BeamSearchParams(3, 10, length_penalty=0.5, early_stopping=True)
    expected = offline.beam_search(["Once upon a time", "The sea"], params)
    texts = [c["text"] for c in out["choices"]]
    assert texts == [beam.text for result in expected for beam in result.sequences]
    reasons = [c["finish_reason"] for c in out["choices"]]
    assert reasons == [
        "stop" if beam.finished else "length" for result in expected for beam in result.sequences
    ]
    tokens = sum(len(beam.token_ids) for result in expected for beam in result.sequences)
    assert out["usage"]["completion_tokens"] == tokens
    served.wait_until_idle()


def test_chat_beams_equal_offline_beam_search_beside_sampled_requests(served, offline):
    """Other requests run while a search goes on; neither changes the other's output."""
    sampled = {"model": MODEL, "messages": CHAT, "max_tokens": 24, "seed": 5, "temperature": 1}
    results: dict[str, httpx.Response] = {}

    def post(name: str, body: dict) -> None:
        results[name] = served.post("/v1/chat/completions", json=body)

    beams = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "n": 4, "use_beam_search": True}
    threads = [
        threading.Thread(target=post, args=("beams", beams)),
        threading.Thread(target=post, args=("sampled", sampled)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    prompt = offline.encode(offline.apply_chat_template(CHAT))
    expected = offline.beam_search([prompt], BeamSearchParams(4, 12))[0].sequences
    got = [c["message"]["content"] for c in results["beams"].json()["choices"]]
    assert got == [beam.text for beam in expected]
    alone = offline.chat(CHAT, SamplingParams(max_tokens=24, seed=5, temperature=1))[0].text
    assert results["sampled"].json()["choices"][0]["message"]["content"] == alone
    served.wait_until_idle()


def stream_events(served, path: str, body: dict) -> list[dict]:  # noqa: ANN001
    """The JSON events of a streamed request, ``[DONE]`` checked and left out."""
    with httpx.stream("POST", served.url + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_streamed_search_sends_each_choice_whole(served):
    completion = {
        "model": MODEL, "prompt": ["Once upon a time", "The sea"], "max_tokens": 8, "n": 2,
        "use_beam_search": True,
    }  # fmt: skip
    whole = served.post("/v1/completions", json=completion).json()["choices"]
    events = stream_events(served, "/v1/completions", completion)
    streamed = [c for e in events for c in e["choices"]]
    assert sorted((c["index"], c["text"], c["finish_reason"]) for c in streamed) == [
        (c["index"], c["text"], c["finish_reason"]) for c in whole
    ]
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "n": 3, "use_beam_search": True}
    whole = served.post("/v1/chat/completions", json=chat).json()["choices"]
    events = stream_events(served, "/v1/chat/completions", chat)
    texts, reasons = [""] * 3, [None] * 3
    for event in events:
        for c in event["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
            reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    assert texts == [c["message"]["content"] for c in whole]
    assert reasons == [c["finish_reason"] for c in whole]
    served.wait_until_idle()


def test_a_search_at_a_temperature_is_llm_beam_search_at_it(served, offline):
    body = {
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "n": 3,
        "use_beam_search": True, "temperature": 0.5,
    }  # fmt: skip
    texts = [c["text"] for c in served.post("/v1/completions", json=body).json()["choices"]]
    hot = offline.beam_search("Once upon a time", BeamSearchParams(3, 8, temperature=0.5))
    assert texts == [beam.text for beam in hot[0].sequences]
    plain = offline.beam_search("Once upon a time", BeamSearchParams(3, 8))
    assert texts != [beam.text for beam in plain[0].sequences]  # the temperature counts
    for t in (0, 1):  # unset, 0 and 1 all rank by the model's own log-probabilities
        same = served.post("/v1/completions", json={**body, "temperature": t}).json()
        assert [c["text"] for c in same["choices"]] == [beam.text for beam in plain[0].sequences]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 11}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"stop": ["."]}, "stop"),
        ({"top_p": 0.5}, "top_p"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_what_a_search_cannot_honour_is_refused(served, extra, param):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "use_beam_search": True, **extra}
    response = served.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_responses_api_refuses_a_search(served):
    body = {"model": MODEL, "input": "Hi", "use_beam_search": True}
    response = served.post("/v1/responses", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "use_beam_search"


def test_a_client_that_leaves_mid_search_leaves_nothing_behind(served):
    body = {"model": MODEL, "prompt": "x" * 40, "max_tokens": 200, "n": 8, "use_beam_search": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(served.url + "/v1/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 10  # the handler sees the client gone, between steps or in one
    while served.state.gate.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.state.gate.num_running == 0
    served.wait_until_idle()  # the step in flight aborted, its blocks freed
