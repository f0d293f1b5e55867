"""vLLM's score and rerank routes (``/score``, ``/rerank`` and their ``/v1`` and ``/v2`` paths):
scores equal to ``LLM.score`` on the same weights, under every name vLLM takes; rerank results
best first, ``top_n`` of them; requests of more texts than run at once go in waves; bad requests
get a 4xx that names the field, and nothing is left on the engine."""

from __future__ import annotations

import httpx
import pytest

from specdec.serving import ServerConfig

from .conftest import MODEL
from .test_errors import wait_for

QUERY = "The capital of France"
DOCUMENTS = ["The capital of France", "hello", "x" * 300, "Paris is a city in France"]


def offline_scores(offline, query, documents) -> list[float]:  # noqa: ANN001
    return [o.outputs.score for o in offline.score(query, documents)]


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
@pytest.mark.parametrize(("first", "second"), [
    ("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"),
])  # fmt: skip
def test_score_under_every_name_is_llm_score(served, offline, path, first, second):
    response = served.post(path, json={"model": MODEL, first: QUERY, second: DOCUMENTS})
    body = response.json()
    assert response.status_code == 200, body
    assert body["object"] == "list" and body["model"] == MODEL and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert all(d["object"] == "score" for d in body["data"])
    expected = offline_scores(offline, QUERY, DOCUMENTS)
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-6)
    tokens = sum(len(offline.encode(t)) for t in [QUERY, *DOCUMENTS])  # each text ran once
    assert body["usage"] == {
        "prompt_tokens": tokens,
        "completion_tokens": 0,
        "total_tokens": tokens,
    }
    served.wait_until_idle()


def test_score_pair_by_pair_and_truncation(served, offline):
    firsts, seconds = DOCUMENTS[:2], DOCUMENTS[2:]
    body = served.post("/score", json={"text_1": firsts, "text_2": seconds}).json()
    expected = offline_scores(offline, firsts, seconds)
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-6)
    truncated = served.post(
        "/score", json={"text_1": "x" * 300, "text_2": ["x" * 5], "truncate_prompt_tokens": 5}
    ).json()
    assert truncated["data"][0]["score"] == pytest.approx(1.0, abs=1e-6)
    assert truncated["usage"]["prompt_tokens"] == 10


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_best_first(served, offline, path):
    scores = offline_scores(offline, QUERY, DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    body = served.post(path, json={"query": QUERY, "documents": DOCUMENTS}).json()
    assert body["model"] == MODEL and body["id"].startswith("rerank-")
    assert [r["index"] for r in body["results"]] == order and order[0] == 0
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(scores[result["index"]], abs=1e-6)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    tokens = sum(len(offline.encode(t)) for t in [QUERY, *DOCUMENTS])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_rerank_top_n_document_objects_and_return_documents(served, offline):
    objects = [{"text": d} for d in DOCUMENTS]
    body = {"query": QUERY, "documents": objects, "top_n": 2, "return_documents": False}
    results = served.post("/v1/rerank", json=body).json()["results"]
    scores = offline_scores(offline, QUERY, DOCUMENTS)
    assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -scores[i])[:2]
    assert all(set(r) == {"index", "relevance_score"} for r in results)
    many = served.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 9})
    assert len(many.json()["results"]) == 4


def test_more_texts_than_run_at_once_go_in_waves(make_server, offline):
    served = make_server(ServerConfig(served_model_name=MODEL, max_concurrent=3))
    documents = [f"document number {i}" for i in range(10)]
    body = served.post("/rerank", json={"query": QUERY, "documents": documents}).json()
    scores = offline_scores(offline, QUERY, documents)
    assert sorted(r["relevance_score"] for r in body["results"]) == pytest.approx(sorted(scores))
    vectors = served.post("/v1/embeddings", json={"input": documents}).json()["data"]
    assert [d["index"] for d in vectors] == list(range(10))
    assert served.state.gate.num_running == 0


def test_a_client_that_leaves_mid_rerank_leaves_nothing(make_server):
    # waves of 2 texts of 400 tokens, 16 tokens a step: hundreds of steps, far past the timeout
    config = ServerConfig(served_model_name=MODEL, max_concurrent=2)
    served = make_server(config, max_num_batched_tokens=16)
    documents = ["y" * 400 + str(i) for i in range(40)]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            served.url + "/rerank", json={"query": QUERY, "documents": documents}, timeout=0.05
        )
    wait_for(lambda: served.state.gate.num_running == 0)
    served.wait_until_idle()


@pytest.mark.parametrize(
    ("path", "body", "status", "message", "param"),
    [
        ("/score", {"text_1": "a"}, 400, "text_1 and text_2", "text_1"),
        ("/score", {"text_1": "a", "documents": ["b"]}, 400, "documents, text_1", "text_1"),
        ("/score", {"text_1": "a", "text_2": "b", "data_1": "c"}, 400, "data_1", "text_1"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "2 texts", "text_2"),
        ("/score", {"text_1": [], "text_2": ["b"]}, 400, "text_1 is empty", "text_1"),
        ("/score", {"text_1": "a", "text_2": []}, 400, "text_2 is empty", "text_2"),
        ("/score", {"text_1": "", "text_2": "b"}, 400, "at least 1", "text_1"),
        ("/score", {"text_1": [3], "text_2": "b"}, 400, "string", "text_1"),
        ("/score", {"text_1": "a", "text_2": "b", "model": "gpt"}, 404, "does not exist", "model"),
        ("/score", {"text_1": "a", "text_2": "b", "priority": 1}, 400, "priority", "priority"),
        ("/rerank", {"query": "a"}, 400, "required", "documents"),
        ("/rerank", {"query": "a", "documents": []}, 400, "documents is empty", "documents"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, 400, "0", "top_n"),
        (
            "/rerank",
            {"query": "a", "documents": [{"txt": "b"}]},
            400,
            "non-empty string or",
            "documents",
        ),
        (
            "/v2/rerank",
            {"query": "a", "documents": [[5] * 9]},
            400,
            "non-empty string or",
            "documents",
        ),
        (
            "/rerank",
            {"query": "a", "documents": ["b", "x" * 5000]},
            400,
            "context",
            "documents",
        ),
        (
            "/rerank",
            {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 0},
            400,
            "-1",
            "truncate_prompt_tokens",
        ),
    ],
)
def test_bad_requests_name_the_field(served, path, body, status, message, param):
    response = served.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"].split("[")[0] == param, error
    served.wait_until_idle()


def test_scores_need_the_key(make_server):
    served = make_server(ServerConfig(served_model_name=MODEL, api_key="k3y"))
    bodies = {
        "/score": {"text_1": "a", "text_2": "b"},
        "/rerank": {"query": "a", "documents": ["b"]},
    }
    for path in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
        body = bodies["/score" if "score" in path else "/rerank"]
        assert served.post(path, json=body).status_code == 401, path
        keyed = served.post(path, json=body, headers={"Authorization": "Bearer k3y"})
        assert keyed.status_code == 200, path
