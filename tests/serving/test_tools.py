"""Function calling: tool_choice "required" or a named function makes the reply calls whose
arguments follow the functions' schemas (guided decoding), handed back as tool_calls, whole or
streamed; a conversation carries the calls and their answers; what cannot be served is refused."""

from __future__ import annotations

import json
import re

import pytest

from specdec import LLM, SamplingParams
from specdec.llm import ChatOptions
from specdec.serving import ServerConfig
from specdec.serving.protocol import ChatCompletionRequest
from specdec.serving.responses_api import ResponsesRequest
from specdec.serving.routes import auto_tools
from specdec.serving.tool_parsers import SYNTAXES
from specdec.serving.tools import calls_schema
from tests.test_structural_tag import accepts
from tests.tiny import byte_tokenizer, tiny_model

from .conftest import MODEL, start_server
from .test_errors import assert_error

UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": UNIT}},
    {"type": "function", "function": {"name": "clock", "description": "The time"}},
]
CHAT = [{"role": "user", "content": "Weather?"}]
NAMED = {"type": "function", "function": {"name": "weather"}}


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(tiny_model("llama"), tokenizer=byte_tokenizer(), num_kv_blocks=64)


def schema_of(tool_choice):  # noqa: ANN001, ANN201
    body = ChatCompletionRequest(messages=CHAT, tools=TOOLS, tool_choice=tool_choice)
    return calls_schema(body.tools or [], body.tool_choice)


def test_a_named_function_is_called_with_arguments_its_schema_accepts(served, offline):
    params = SamplingParams(temperature=0, max_tokens=40, json_schema=UNIT)
    expected = offline.chat(CHAT, params)[0]
    assert expected.finish_reason == "stop" and json.loads(expected.text.rstrip("#"))
    body = {"messages": CHAT, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 40,
            "temperature": 0}  # fmt: skip
    reply = served.client().chat.completions.create(model=MODEL, **body)
    message = reply.choices[0].message
    assert message.content is None and reply.choices[0].finish_reason == "stop"
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    arguments = expected.text.rstrip("#")  # "#": an EOS id of the tiny tokenizer
    assert call.function.name == "weather" and call.function.arguments == arguments
    events = served.client().chat.completions.create(model=MODEL, stream=True, **body)
    deltas = [c.choices[0].delta for c in events if c.choices]
    assert deltas[0].tool_calls[0].function.name == "weather" and deltas[0].tool_calls[0].id
    streamed = "".join(d.tool_calls[0].function.arguments for d in deltas if d.tool_calls)
    assert streamed == expected.text  # streamed as generated: the EOS's own text too


def test_required_calls_are_an_array_of_calls_parsed_into_tool_calls(served, offline):
    params = SamplingParams(temperature=0, max_tokens=200, json_schema=schema_of("required"))
    expected = offline.chat(CHAT, params)[0]
    assert expected.finish_reason == "stop", expected.text
    calls = json.loads(expected.text.rstrip("#"))
    body = {"messages": CHAT, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
            "temperature": 0}  # fmt: skip
    reply = served.client().chat.completions.create(model=MODEL, **body)
    assert reply.choices[0].finish_reason == "tool_calls"
    got = reply.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == [
        (c["name"], c["parameters"]) for c in calls
    ]
    events = list(served.client().chat.completions.create(model=MODEL, stream=True, **body))
    streamed = [t for c in events if c.choices and c.choices[0].delta.tool_calls
                for t in c.choices[0].delta.tool_calls]  # fmt: skip
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == [
        (k, c.function.name, c.function.arguments) for k, c in enumerate(got)
    ]
    assert [c.choices[0].finish_reason for c in events if c.choices][-1] == "tool_calls"


def test_a_reply_cut_short_stays_text(served):
    body = {"messages": CHAT, "tools": TOOLS, "tool_choice": "required", "max_tokens": 3}
    reply = served.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert reply["finish_reason"] == "length" and reply["message"]["content"].startswith("[")


def test_a_conversation_carries_calls_and_their_answers(served):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"unit": "c"}'}}  # fmt: skip
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]  # fmt: skip
    body = {"messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4}
    reply = served.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


def test_tools_and_calls_reach_the_chat_template(offline):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = (
        "{{ tools | tojson }}|{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}{{ c.function.arguments.unit }}{% endfor %}"
        "{% endfor %}"
    )
    llm = LLM(tiny_model("llama"), tokenizer=tokenizer, num_kv_blocks=16)
    call = {
        "id": "1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"unit": "f"}'},
    }
    body = ChatCompletionRequest(
        messages=[*CHAT, {"role": "assistant", "tool_calls": [call]}], tools=TOOLS,
        tool_choice="none", add_generation_prompt=False, continue_final_message=False,
    )  # fmt: skip
    text = llm.render_chat(body.conversation(), body.chat_options())
    assert text.startswith('[{"type": "function", "function": {"name": "weather"')
    assert text.endswith("|user:Weather?assistant:f")  # the arguments as an object
    assert llm.render_chat(CHAT, ChatOptions(add_generation_prompt=False)).startswith("null|")
    out = llm.chat(CHAT, SamplingParams(max_tokens=1), add_generation_prompt=False, tools=TOOLS)
    assert llm.decode(out[0].prompt_token_ids).startswith('[{"type": "function"')


C = "/v1/chat/completions"


@pytest.mark.parametrize(
    "extra, fragment, param",
    [
        ({"tools": TOOLS}, 'tool_choice is "auto" (the default with tools)', "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "--enable-auto-tool-choice", "tool_choice"),
        ({"tools": TOOLS, "echo": True}, "cannot be combined with echo", "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice: needs tools", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "names 'nope', which is not among the tools", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
         "give one of guided_regex and tool_choice", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "echo": True},
         "cannot be combined with echo", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
         "give one of response_format and tool_choice", "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"multipleOf": 1}}}],
          "tool_choice": "required"}, "json_schema keyword 'multipleOf' is not supported", "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"},
         "String should match pattern", "tools[0].function.name"),
        ({"tools": [{"type": "code_interpreter"}], "tool_choice": "none"}, "Input should be 'function'", "tools[0].type"),
    ],
)  # fmt: skip
def test_tool_requests_that_cannot_be_served_are_refused(served, extra, fragment, param):
    response = served.post(C, json={"messages": CHAT, "max_tokens": 2} | extra)
    assert_error(response, 400, fragment, param)


CALL_TEXT = 'Let me look.<tool_call>{"name": "weather", "arguments": {"unit": "c"}}</tool_call>'


@pytest.fixture(scope="module")
def auto_served():
    """A server that takes tool_choice "auto", reading calls in Hermes' syntax."""
    config = ServerConfig(
        served_model_name=MODEL, enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    served = start_server(config)
    yield served
    served.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_calls_the_model_writes(auto_served, stream):
    """Under "auto" the reply is free text; the calls the model wrote in it (forced here by a
    guide, the tiny model being random) come back as tool_calls, the text before them as content."""
    body = {"messages": CHAT, "tools": TOOLS, "max_tokens": 120, "temperature": 0,
            "extra_body": {"guided_regex": re.escape(CALL_TEXT)}}  # fmt: skip
    client = auto_served.client()
    if not stream:
        reply = client.chat.completions.create(model=MODEL, **body).choices[0]
        content, calls, reason = (
            reply.message.content,
            reply.message.tool_calls,
            reply.finish_reason,
        )
    else:
        chunks = [c.choices[0] for c in client.chat.completions.create(model=MODEL, stream=True, **body)
                  if c.choices]  # fmt: skip
        content = "".join(c.delta.content or "" for c in chunks)
        calls = [t for c in chunks for t in c.delta.tool_calls or []]
        reason = chunks[-1].finish_reason
        assert all(c.delta.tool_calls is None for c in chunks[:-1])  # the calls come last, whole
    assert content == "Let me look." and reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("weather", {"unit": "c"})
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_hands_back_text_that_holds_no_whole_call(auto_served, stream):
    """A reply without calls, a call to no given tool, or a call cut short stays text."""
    client = auto_served.client()
    for text, max_tokens, reason in [
        ("Sunny, I think.", 60, "stop"),
        ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', 80, "stop"),
        (CALL_TEXT, 30, "length"),
    ]:
        body = {"messages": CHAT, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0,
                "extra_body": {"guided_regex": re.escape(text)}}  # fmt: skip
        if not stream:
            reply = client.chat.completions.create(model=MODEL, **body).choices[0]
            got, got_reason = reply.message.content, reply.finish_reason
            assert reply.message.tool_calls is None
        else:
            chunks = [c.choices[0] for c in client.chat.completions.create(
                model=MODEL, stream=True, **body) if c.choices]  # fmt: skip
            got, got_reason = (
                "".join(c.delta.content or "" for c in chunks),
                chunks[-1].finish_reason,
            )
            assert all(c.delta.tool_calls is None for c in chunks)
        assert got_reason == reason and got.rstrip("#") == text[: len(got.rstrip("#"))]
        assert got.rstrip("#") == text or reason == "length"


STRICT = [{"type": "function", "function": {"name": "weather", "parameters": UNIT, "strict": True}},
          TOOLS[1]]  # fmt: skip


def test_strict_tools_under_auto_hold_each_call_to_its_schema(auto_served, offline):
    """With a strict tool, "auto" replies are guided by the parser's structural tag: free text,
    and each call in Hermes' syntax with its function's arguments (a loose tool's: any object);
    not where the request gives its own guide, nor without a strict tool."""
    tag = SYNTAXES["hermes"].strict([("weather", UNIT), ("clock", {"type": "object"})])
    tag = tag["structural_tag"]
    call = '<tool_call>\n{"name": "weather", "arguments": {"unit": "c"}}\n</tool_call>'
    assert accepts(tag, "Let me look." + call) and accepts(tag, "No call needed.")
    assert accepts(tag, call.replace('"weather", "arguments": {"unit": "c"}', '"clock", '
                                      '"arguments": {"any": [1]}'))  # fmt: skip
    assert not accepts(tag, call.replace('"c"', '"k"'))  # the schema's enum
    assert not accepts(tag, call.replace("weather", "nope"))  # no such tool
    body = {"messages": CHAT, "tools": STRICT, "max_tokens": 40, "temperature": 0}
    reply = auto_served.post(C, json=body).json()["choices"][0]["message"]["content"]
    params = SamplingParams(temperature=0, max_tokens=40, structural_tag=tag)
    assert reply == offline.chat(CHAT, params, tools=STRICT)[0].text
    for tools, extra, guided in [
        (STRICT, {}, True),
        (TOOLS, {}, False),
        (STRICT, {"guided_regex": "[a-z]+"}, False),
        (STRICT, {"tool_choice": "none"}, False),
    ]:
        request = ChatCompletionRequest.model_validate({"messages": CHAT, "tools": tools, **extra})
        auto_tools(auto_served.state, request)
        assert ("structural_tag" in request.guide()) == guided, (tools, extra)
    flat = {"type": "function", "name": "weather", "parameters": UNIT, "strict": True}
    request = ResponsesRequest.model_validate({"input": "Weather?", "tools": [flat]})
    auto_tools(auto_served.state, request)  # the Responses API's tools, flat, the same
    assert request.guide() == SYNTAXES["hermes"].strict([("weather", UNIT)])
    unfollowable = [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"multipleOf": 1}}}]  # fmt: skip
    response = auto_served.post(C, json={**body, "tools": unfollowable})
    assert_error(response, 400, "json_schema keyword 'multipleOf' is not supported", "tools")
    loose = [{"type": "function", "function": {"name": "f", "parameters": {"multipleOf": 1}}}]
    assert auto_served.post(C, json={**body, "tools": loose}).status_code == 200
    # beside a strict tool, a loose one's arguments are any object: its schema is not compiled
    assert auto_served.post(C, json={**body, "tools": [STRICT[0], *loose]}).status_code == 200


SYNTAX_REPLIES = {  # each parser's syntax, as a model that writes it would reply
    "mistral": 'Sure.[TOOL_CALLS][{"name": "weather", "arguments": {"unit": "c"}}]',
    "llama3_json": '{"name": "weather", "parameters": {"unit": "c"}}',
    "pythonic": '[weather(unit="c")]',
    "qwen3_coder": "<tool_call>\n<function=weather>\n<parameter=unit>\nc\n</parameter>\n"
    "</function>\n</tool_call>",
}


@pytest.mark.parametrize("syntax", list(SYNTAX_REPLIES))
def test_each_parser_reads_its_syntax_whole_and_streamed(make_server, syntax):
    config = ServerConfig(
        served_model_name=MODEL, enable_auto_tool_choice=True, tool_call_parser=syntax
    )
    served = make_server(config)
    engine, skips = served.llm.engine, []
    add = engine.add_request
    engine.add_request = lambda ids, params, priority=0, lora=None: (  # type: ignore[method-assign]
        skips.append(params.skip_special_tokens) or add(ids, params, priority, lora)
    )
    text = SYNTAX_REPLIES[syntax]
    body = {"messages": CHAT, "tools": TOOLS, "max_tokens": 120, "temperature": 0,
            "extra_body": {"guided_regex": re.escape(text)}}  # fmt: skip
    client = served.client()
    reply = client.chat.completions.create(model=MODEL, **body).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(model=MODEL, stream=True, **body)
              if c.choices]  # fmt: skip
    streamed = [t for c in chunks for t in c.delta.tool_calls or []]
    expected = [("weather", {"unit": "c"})]
    for calls in (reply.message.tool_calls, streamed):
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
    content = "Sure." if syntax == "mistral" else None
    assert reply.message.content == content and reply.finish_reason == "tool_calls"
    assert "".join(c.delta.content or "" for c in chunks) == (content or "")
    assert skips == [syntax != "mistral"] * 2  # [TOOL_CALLS] is a special token: kept


def test_structural_tags_as_vllm_takes_them(served, offline):
    """``response_format`` (both of vLLM's spellings) and ``structured_outputs`` give the offline
    engine's output under the tag, which opens the reply here (at_least_one)."""
    n = {"begin": "<f=n>", "end": "</f>"}
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<f="],
            "at_least_one": True,
            "tags": [{**n, "content": {"type": "regex", "pattern": "[0-9]+"}}],
        },
    }
    legacy = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{**n, "schema": {"type": "integer"}}]}  # fmt: skip
    for spec, bodies in [
        (
            tag,
            [{"structured_outputs": {"structural_tag": json.dumps(tag)}}, {"response_format": tag}],
        ),
        (legacy, [{"response_format": legacy}]),
    ]:
        params = SamplingParams(temperature=0, max_tokens=24, structural_tag=spec)
        expected = offline.chat(CHAT, params)[0].text
        assert spec is legacy or expected.startswith("<f=n>"), expected
        for extra in bodies:
            body = {"messages": CHAT, "max_tokens": 24, "temperature": 0} | extra
            reply = served.post(C, json=body).json()
            assert reply["choices"][0]["message"]["content"] == expected, extra


def test_strict_tools_under_auto_with_the_pythonic_parser(offline):
    """The pythonic syntax's guide is a regex of Python calls: the served reply is the offline
    one under it; a strict tool whose properties cannot be keywords is refused with 400."""
    config = ServerConfig(
        served_model_name=MODEL, enable_auto_tool_choice=True, tool_call_parser="pythonic"
    )
    served = start_server(config)
    try:
        body = {"messages": CHAT, "tools": STRICT, "max_tokens": 40, "temperature": 0}
        reply = served.post(C, json=body).json()["choices"][0]["message"]
        guide = SYNTAXES["pythonic"].strict([("weather", UNIT), ("clock", {"type": "object"})])
        params = SamplingParams(temperature=0, max_tokens=40, **guide)
        assert reply["content"] == offline.chat(CHAT, params, tools=STRICT)[0].text
        dashed = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
            "type": "object", "properties": {"my-key": {"type": "string"}}}}}]  # fmt: skip
        response = served.post(C, json={**body, "tools": dashed})
        assert_error(response, 400, "'my-key' is not a Python identifier", "tools")
    finally:
        served.stop()
