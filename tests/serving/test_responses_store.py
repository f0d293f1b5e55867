"""Stored responses (``--responses-store``): previous_response_id continues a conversation as if
it were sent whole; GET gives a response back, DELETE forgets it; without a store, 400."""

from __future__ import annotations

import httpx

from specdec import SamplingParams
from specdec.serving import ServerConfig

from .conftest import MODEL
from .test_errors import assert_error
from .test_responses_api import INSTRUCTIONS, QUESTION, WEATHER


def test_stored_responses_continue_their_conversation(make_server, offline):
    """--responses-store: previous_response_id puts the earlier input and output before the new
    input (the new instructions replacing the old), as if the whole conversation were sent;
    GET gives a stored response back, DELETE forgets it, and the store keeps the last N."""
    served = make_server(ServerConfig(served_model_name=MODEL, responses_store=2))
    client = served.client()
    greedy = {"model": MODEL, "max_output_tokens": 6, "temperature": 0}
    first = client.responses.create(instructions=INSTRUCTIONS, input=QUESTION, **greedy)
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(
        previous_response_id=first.id, instructions="Be terse.", input="Another?", **greedy
    )
    assert second.previous_response_id == first.id
    conversation = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another?"},
    ]
    expected = offline.chat(conversation, SamplingParams(max_tokens=6, temperature=0))[0]
    assert second.output_text == expected.text
    assert second.usage.input_tokens == len(offline.apply_chat_template(conversation))
    streamed = client.responses.create(  # a stream is stored too, and chains on
        previous_response_id=second.id, input="And?", stream=True, **greedy
    )
    done = list(streamed)[-1].response  # cut at max_output_tokens: "response.incomplete"
    assert done.previous_response_id == second.id and done.store is True
    assert client.responses.retrieve(done.id).output_text == done.output_text
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    missing = httpx.get(f"{served.url}/v1/responses/{first.id}", timeout=10)  # the oldest of 3
    assert_error(missing, 404, "not found", None)
    deleted = httpx.delete(f"{served.url}/v1/responses/{second.id}", timeout=10)
    assert deleted.json() == {"id": second.id, "object": "response.deleted", "deleted": True}
    continued = served.post(
        "/v1/responses", json={**greedy, "input": "x", "previous_response_id": second.id}
    )
    assert_error(
        continued, 404, f"Response with id '{second.id}' not found", "previous_response_id"
    )
    unstored = client.responses.create(input=QUESTION, store=False, **greedy)
    assert unstored.store is False
    assert httpx.get(f"{served.url}/v1/responses/{unstored.id}", timeout=10).status_code == 404


def test_a_server_without_a_store_has_no_stored_responses(served):
    response = httpx.get(f"{served.url}/v1/responses/resp_1", timeout=10)
    assert_error(response, 400, "--responses-store N", None)


def test_a_stored_call_is_answered_by_naming_its_response(make_server):
    """The continued conversation equals the one sent whole: the stored calls come back as the
    assistant's calls, before the new function_call_output."""
    served = make_server(ServerConfig(served_model_name=MODEL, responses_store=4))
    asked = served.post("/v1/responses", json={
        "input": QUESTION, "temperature": 0, "max_output_tokens": 200, "tools": [WEATHER],
        "tool_choice": "required",
    }).json()  # fmt: skip
    calls = [item for item in asked["output"] if item["type"] == "function_call"]
    assert calls and asked["store"] is True
    answers = [{"type": "function_call_output", "call_id": c["call_id"], "output": "Sunny"}
               for c in calls]  # fmt: skip
    rest = {"tools": [WEATHER], "tool_choice": "none", "temperature": 0, "max_output_tokens": 8}
    chained = served.post(
        "/v1/responses", json={"input": answers, "previous_response_id": asked["id"], **rest}
    ).json()
    whole_input = [
        {"role": "user", "content": QUESTION},
        *({k: c[k] for k in ("type", "call_id", "name", "arguments")} for c in calls),
        *answers,
    ]
    whole = served.post("/v1/responses", json={"input": whole_input, **rest}).json()
    assert chained["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert chained["output"][0]["content"] == whole["output"][0]["content"]
