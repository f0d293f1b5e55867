"""OpenAI's Responses API (``POST /v1/responses``) through the real `openai` client: the reply
is the chat template's greedy reply offline, streams concatenate to it, formats guide it, and
what needs stored responses or tools is refused by name (stored responses:
test_responses_store.py)."""

from __future__ import annotations

import json
import re

import pytest

from specdec import SamplingParams

from .conftest import MODEL

INSTRUCTIONS = "Answer briefly."
QUESTION = "Name a prime."
OBJECT_K = {"type": "object", "properties": {"k": {"type": "integer"}}}
CHAT = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]


def test_reply_is_the_chat_templates_reply(served, offline):
    out = served.client().responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=10,
        temperature=0,
    )  # fmt: skip
    expected = offline.chat(CHAT, SamplingParams(max_tokens=10, temperature=0))[0]
    assert out.output_text == expected.text and out.id.startswith("resp")
    assert out.object == "response" and out.model == MODEL and out.store is False
    message = out.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert out.usage is not None
    assert out.usage.input_tokens == len(offline.apply_chat_template(CHAT))
    assert out.usage.output_tokens == len(expected.token_ids) == 10
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.status == "incomplete" and message.status == "incomplete"  # cut at 10 tokens
    assert out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.instructions == INSTRUCTIONS and out.max_output_tokens == 10


def test_message_items_and_text_parts(served, offline):
    """A conversation as input items (content as text or as input_text/output_text parts)."""
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Bye"}]},
    ]
    out = served.client().responses.create(
        model=MODEL,
        input=conversation,  # type: ignore[arg-type]
        max_output_tokens=8,
        temperature=0,
    )
    chat = [{"role": m["role"], "content": "Hello." if m["role"] == "assistant" else m["content"]}
            for m in conversation]  # fmt: skip
    chat[2]["content"] = "Bye"
    expected = offline.chat(chat, SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.output_text == expected.text


def test_stream_events_concatenate_to_the_reply(served):
    client = served.client()
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 12, "temperature": 0}
    full = client.responses.create(**body)  # type: ignore[call-overload]
    events = list(client.responses.create(**body, stream=True))  # type: ignore[call-overload]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # cut at max_output_tokens
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == full.output_text
    last = events[-1].response
    assert last.output_text == full.output_text and last.usage.output_tokens == 12
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_a_reply_that_ends_is_completed(served):
    out = served.post(
        "/v1/responses",
        json={"input": QUESTION, "temperature": 0, "text": {"format": {"type": "json_schema",
              "name": "n", "schema": {"type": "object", "properties": {"n": {"enum": [1, 2]}},
                                      "required": ["n"], "additionalProperties": False}}}},
    ).json()  # fmt: skip
    assert out["status"] == "completed" and out["incomplete_details"] is None
    text = out["output"][0]["content"][0]["text"]
    assert json.loads(text.rstrip("#"))["n"] in (1, 2)  # "#": an EOS id of the tiny tokenizer
    assert out["text"]["format"]["type"] == "json_schema"


@pytest.mark.parametrize(
    "guide",
    [
        ({"json_schema": {"type": "object"}}, {"text": {"format": {"type": "json_object"}}}),
        (
            {"json_schema": OBJECT_K},
            {"text": {"format": {"type": "json_schema", "name": "k", "schema": OBJECT_K}}},
        ),
        ({"regex": "[ab]{3}"}, {"guided_regex": "[ab]{3}"}),  # vLLM's extras are taken too
        ({"regex": "[ab]{3}"}, {"guided_regex": "[ab]{3}", "text": {"format": {"type": "text"}}}),
    ],
)
def test_formats_guide_the_reply(served, offline, guide):
    params, extra = guide
    expected = offline.chat(CHAT[1:], SamplingParams(temperature=0, max_tokens=20, **params))
    body = {"input": QUESTION, "temperature": 0, "max_output_tokens": 20} | extra
    out = served.post("/v1/responses", json=body).json()
    assert out["output"][0]["content"][0]["text"] == expected[0].text


def test_seeded_sampling_is_reproducible(served):
    client = served.client()
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 16, "temperature": 1.0}
    seeded = [
        client.responses.create(**body, extra_body={"seed": 5}).output_text  # type: ignore[call-overload]
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "--responses-store N"),
        ({"background": True}, "background", "not supported"),
        (
            {"tools": [{"type": "function", "name": "f"}]},
            "tool_choice",
            "--enable-auto-tool-choice",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "tool_choice",
            "not among the tools",
        ),  # fmt: skip
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function"),
        (
            {
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "tool_choice",
            "give one of text.format and tool_choice",
        ),  # fmt: skip
        ({"truncation": "auto"}, "truncation", "not supported"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "not supported"),
        ({"n": 2}, "n", "not supported"),
        ({"input": []}, "input", "a text or a non-empty list of messages"),
        ({"input": [{"type": "file_search_call"}]}, "input", "only message, function_call"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input", "needs call_id, name"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input", "call_id, output"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "role must be one of"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input",
            "only text content parts",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"max_output_tokens": 10**6}, "max_output_tokens", "is too large"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
        (
            {"text": {"format": {"type": "json_object"}}, "guided_regex": "a"},
            "text",
            "give one of guided_regex and text.format",
        ),
        ({"model": "other"}, "model", "does not exist"),
    ],
)
def test_bad_requests_are_refused_by_name(served, body, param, message):
    reply = served.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": 4} | body)
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error
    served.wait_until_idle()


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_as_chat_completions_call_it(served, stream):
    """The call's arguments are the chat route's for the same tools and tool_choice."""
    chat = served.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 40,
        "tools": [CHAT_WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }).json()["choices"][0]["message"]["tool_calls"][0]  # fmt: skip
    body = {"input": QUESTION, "temperature": 0, "max_output_tokens": 40, "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"}}  # fmt: skip
    client = served.client()
    if not stream:
        out = client.responses.create(model=MODEL, **body)  # type: ignore[call-overload]
    else:
        events = list(client.responses.create(model=MODEL, stream=True, **body))  # type: ignore[call-overload]
        kinds = [e.type for e in events]
        assert "response.output_text.delta" not in kinds
        assert kinds[2:] == [
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert events[3].delta == events[4].arguments == events[5].item.arguments
        out = events[-1].response
    call = out.output[0]
    assert out.status == "completed" and len(out.output) == 1
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == chat["function"]["arguments"] and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")


def test_required_calls_and_a_conversation_that_answers_them(served):
    """ "required" gives function_call items; a conversation carries them back with their
    outputs, rendered as chat completions render the same turns."""
    out = served.post("/v1/responses", json={
        "input": QUESTION, "temperature": 0, "max_output_tokens": 200, "tools": [WEATHER],
        "tool_choice": "required",
    }).json()  # fmt: skip
    assert out["status"] == "completed" and out["output"]
    assert {item["type"] for item in out["output"]} == {"function_call"}
    call = out["output"][0]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in (
        "Paris",
        "Rome",
    )
    answered = [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call["call_id"], "name": call["name"],
         "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 21 C"},
    ]  # fmt: skip
    body = {"input": answered, "tools": [WEATHER], "tool_choice": "none", "temperature": 0,
            "max_output_tokens": 12}  # fmt: skip
    reply = served.post("/v1/responses", json=body).json()
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call["call_id"],
         "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "Sunny, 21 C"},
    ]  # fmt: skip
    chat = served.post("/v1/chat/completions", json={
        "messages": messages, "tools": [CHAT_WEATHER], "tool_choice": "none", "temperature": 0,
        "max_tokens": 12,
    }).json()  # fmt: skip
    assert reply["output"][0]["type"] == "message"
    text = reply["output"][0]["content"][0]["text"]
    assert text == chat["choices"][0]["message"]["content"]
    assert reply["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_calls_cut_short_stay_text(served):
    body = {"input": QUESTION, "tools": [WEATHER], "tool_choice": "required",
            "max_output_tokens": 3}  # fmt: skip
    out = served.post("/v1/responses", json=body).json()
    assert out["status"] == "incomplete" and out["output"][0]["type"] == "message"
    assert out["output"][0]["content"][0]["text"].startswith("[")
    events = list(served.client().responses.create(model=MODEL, stream=True, **body))  # type: ignore[call-overload]
    assert [e.type for e in events][-1] == "response.incomplete"
    assert events[-1].response.output[0].content[0].text.startswith("[")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_calls_the_model_writes(stream):
    """Under "auto", on a server with a parser: the text before the calls is a message item,
    each call a function_call item (the calls forced by a guide, the tiny model being random)."""
    from specdec.serving import ServerConfig

    from .conftest import start_server

    config = ServerConfig(
        served_model_name=MODEL, enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    served = start_server(config)
    try:
        text = 'On it.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
        body = {"model": MODEL, "input": QUESTION, "tools": [WEATHER], "temperature": 0,
                "max_output_tokens": 120, "extra_body": {"guided_regex": re.escape(text)}}  # fmt: skip
        client = served.client()
        if stream:
            events = list(client.responses.create(stream=True, **body))  # type: ignore[call-overload]
            kinds = [e.type for e in events]
            assert "response.function_call_arguments.done" in kinds
            # the text went out as it came, before the calls were known
            deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
            assert len(deltas) > 1 and "".join(deltas) == "On it."
            assert kinds.index("response.output_text.delta") < kinds.index(
                "response.function_call_arguments.delta"
            )
            out = events[-1].response
        else:
            out = client.responses.create(**body)  # type: ignore[call-overload]
        assert out.status == "completed" and [item.type for item in out.output] == [
            "message",
            "function_call",
        ]
        assert out.output[0].content[0].text == "On it."
        assert out.output[1].name == "get_weather"
        assert json.loads(out.output[1].arguments) == {"city": "Rome"}
    finally:
        served.stop()
