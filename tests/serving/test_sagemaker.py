"""SageMaker's routes, as vLLM serves them: /ping, and /invocations answering a chat completions
or completions body as that route does."""

from __future__ import annotations

import httpx

from specdec.serving import ServerConfig

from .conftest import MODEL
from .test_errors import assert_error

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
PROMPT = {"prompt": "Once upon", "max_tokens": 6, "temperature": 0}


def test_ping_is_the_health_check(served):
    for method in ("GET", "POST"):
        response = httpx.request(method, served.url + "/ping", timeout=10)
        assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_invocations_answer_as_the_route_their_body_belongs_to(served):
    for body, route, text in ((CHAT, "/v1/chat/completions", lambda c: c["message"]["content"]),
                              (PROMPT, "/v1/completions", lambda c: c["text"])):  # fmt: skip
        expected = served.post(route, json=body).json()
        got = served.post("/invocations", json=body).json()
        assert got["object"] == expected["object"] and got["usage"] == expected["usage"]
        assert text(got["choices"][0]) == text(expected["choices"][0])
    with httpx.stream(
        "POST", served.url + "/invocations", json={**PROMPT, "stream": True}, timeout=30
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.read().decode().endswith("data: [DONE]\n\n")


def test_bad_invocations_get_the_routes_errors(served):
    both = {**CHAT, "prompt": "x"}
    assert_error(served.post("/invocations", json=both), 400, "either messages")
    assert_error(served.post("/invocations", json={"max_tokens": 3}), 400, "either messages")
    assert_error(served.post("/invocations", content=b"{oops"), 400, "not valid JSON")
    bad = served.post("/invocations", json={**PROMPT, "max_tokens": "six"})
    assert_error(bad, 400, "max_tokens", "max_tokens")


def test_invocations_need_the_key_and_ping_does_not(make_server):
    served = make_server(ServerConfig(served_model_name=MODEL, api_key="k3y"))
    assert served.post("/invocations", json=PROMPT).status_code == 401
    keyed = served.post("/invocations", json=PROMPT, headers={"Authorization": "Bearer k3y"})
    assert keyed.status_code == 200
    assert httpx.get(served.url + "/ping", timeout=10).status_code == 200
