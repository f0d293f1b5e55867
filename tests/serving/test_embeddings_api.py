"""``POST /v1/embeddings``: OpenAI's API (the ``openai`` client's calls, base64 included) and
vLLM's extra fields, equal to ``LLM.embed`` on the same weights; bad requests get a 4xx that
names the field, and nothing is left on the engine."""

from __future__ import annotations

import base64
import json
import threading

import httpx
import numpy as np
import pytest

from specdec.pooling import PoolingParams
from specdec.serving import ServerConfig

from .conftest import MODEL
from .test_errors import assert_error

TEXTS = ["The capital of France", "hello", "x" * 300]


def offline_vectors(offline, prompts, **kwargs) -> list[np.ndarray]:  # noqa: ANN001
    return [np.array(o.outputs.embedding) for o in offline.embed(prompts, **kwargs)]


def test_the_openai_client_gets_llm_embed_vectors(served, offline):
    client = served.client()
    for encoding in ("float", "base64"):  # the client asks for base64 unless told otherwise
        kwargs = {} if encoding == "base64" else {"encoding_format": "float"}
        response = client.embeddings.create(model=MODEL, input=TEXTS, **kwargs)  # type: ignore[arg-type]
        assert response.model == MODEL and response.object == "list"
        assert [d.index for d in response.data] == [0, 1, 2]
        tokens = sum(len(offline.encode(t)) for t in TEXTS)
        assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
        for got, expected in zip(response.data, offline_vectors(offline, TEXTS), strict=True):
            assert got.object == "embedding"
            np.testing.assert_allclose(got.embedding, expected, atol=1e-6)
    served.wait_until_idle()


def test_inputs_in_every_form(served, offline):
    ids = offline.encode("hello there")
    for given in ("hello there", ["hello there"], ids, [ids, ids[:3]]):
        data = served.post("/v1/embeddings", json={"input": given}).json()["data"]
        expected = offline_vectors(offline, [ids, ids[:3]])
        for got, want in zip(data, expected):
            np.testing.assert_allclose(got["embedding"], want, atol=1e-6)
        assert len(data) == (2 if given and isinstance(given[-1], list) else 1)


def test_base64_is_little_endian_float32(served, offline):
    body = {"input": "hello", "encoding_format": "base64"}
    encoded = served.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
    vector = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    np.testing.assert_allclose(vector, offline_vectors(offline, ["hello"])[0], atol=1e-6)


def test_vllm_extras_normalize_and_truncation(served, offline):
    body = {"input": "The capital of France", "normalize": False, "truncate_prompt_tokens": 6}
    response = served.post("/v1/embeddings", json=body).json()
    assert response["usage"]["prompt_tokens"] == 6
    expected = offline_vectors(
        offline, ["The capital of France"],
        pooling_params=PoolingParams(normalize=False, truncate_prompt_tokens=6),
    )[0]  # fmt: skip
    np.testing.assert_allclose(response["data"][0]["embedding"], expected, atol=1e-5)
    assert abs(np.linalg.norm(expected) - 1) > 0.1


def test_embeddings_beside_streamed_generation(served, offline):
    """A chat stream and embedding requests at once: the stream's text is the one it gets
    alone, and every embedding its offline value."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "temperature": 0}
    alone = served.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    results: list[str] = []

    def stream() -> None:
        with httpx.stream(
            "POST", served.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30
        ) as response:
            results.append(response.read().decode())

    thread = threading.Thread(target=stream)
    thread.start()
    vectors = [served.post("/v1/embeddings", json={"input": t}).json() for t in TEXTS]
    thread.join()
    text = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in results[0].splitlines()
        if line.startswith("data: {") and '"choices":[{' in line
    )
    assert text == alone["content"]
    for got, expected in zip(vectors, offline_vectors(offline, TEXTS), strict=True):
        np.testing.assert_allclose(got["data"][0]["embedding"], expected, atol=1e-6)
    served.wait_until_idle()


def test_a_conversation_is_embedded_through_the_chat_template(served, offline):
    """vLLM's chat form: the messages rendered as chat completions render them, the
    assistant's turn left closed unless add_generation_prompt is true."""
    from specdec.llm import ChatOptions

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for opened in (False, True):
        body = {"messages": messages, **({"add_generation_prompt": True} if opened else {})}
        response = served.post("/v1/embeddings", json=body).json()
        ids = offline.apply_chat_template(messages, ChatOptions(add_generation_prompt=opened))
        assert response["usage"]["prompt_tokens"] == len(ids)
        (expected,) = offline_vectors(offline, [ids])
        np.testing.assert_allclose(response["data"][0]["embedding"], expected, atol=1e-6)
    both = {"messages": messages, "input": "hi"}
    assert_error(served.post("/v1/embeddings", json=both), 400, "exactly one", "input")
    empty = served.post("/v1/embeddings", json={"messages": []})
    assert_error(empty, 400, "at least one message", "messages")
    template = {"messages": messages, "chat_template": "{{ messages }}"}
    assert_error(served.post("/v1/embeddings", json=template), 400, "--trust", "chat_template")


def test_the_servers_pooling_type(make_server, offline):
    served = make_server(pooling_type="mean")
    data = served.post("/v1/embeddings", json={"input": "hello", "normalize": False}).json()
    reference = served.llm.embed(["hello"], PoolingParams(normalize=False))[0]
    np.testing.assert_allclose(data["data"][0]["embedding"], reference.outputs.embedding, atol=1e-6)
    last = offline_vectors(offline, ["hello"], pooling_params=PoolingParams(normalize=False))[0]
    assert not np.allclose(last, reference.outputs.embedding, atol=1e-3)


@pytest.mark.parametrize(
    ("body", "status", "message", "param"),
    [
        ({"input": "hi", "dimensions": 8}, 400, "Matryoshka", "dimensions"),
        ({"input": ""}, 400, "non-empty", "input"),
        ({"input": []}, 400, "non-empty", "input"),
        ({"input": ["a", []]}, 400, "non-empty", "input"),
        ({"input": [1.5]}, 400, "non-empty", "input"),
        ({}, 400, "exactly one of input or messages", "input"),
        ({"input": "hi", "encoding_format": "int8"}, 400, "float", "encoding_format"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "-1", "truncate_prompt_tokens"),
        ({"input": "hi", "normalize": "yes"}, 400, "bool", "normalize"),
        ({"input": "hi", "model": "gpt-4"}, 404, "does not exist", "model"),
        ({"input": "hi", "priority": 2}, 400, "priority scheduling", "priority"),
        ({"input": [[5] * 600]}, 400, "context holds", "input"),
        ({"input": [[400]]}, 400, "token ids", "input"),
    ],
)
def test_bad_requests_name_the_field(served, body, status, message, param):
    assert_error(served.post("/v1/embeddings", json=body), status, message, param)
    served.wait_until_idle()


def test_embeddings_need_the_key(make_server):
    served = make_server(ServerConfig(served_model_name=MODEL, api_key="k3y"))
    assert served.post("/v1/embeddings", json={"input": "hi"}).status_code == 401
    keyed = served.post(
        "/v1/embeddings", json={"input": "hi"}, headers={"Authorization": "Bearer k3y"}
    )
    assert keyed.status_code == 200 and len(keyed.json()["data"][0]["embedding"]) == 64
