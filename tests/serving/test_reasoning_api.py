"""``--reasoning-parser`` (:mod:`specdec.serving.reasoning`): a reasoning model's ``<think>``
block split from its chat reply into ``reasoning`` (and DeepSeek's ``reasoning_content``), the
same whole and streamed, wherever the tokens break the tags; a prompt that opens the block
(DeepSeek-R1's template) makes the reply start inside it, a guided reply starts outside it;
``include_reasoning: false`` drops it; tool calls are read from the content."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import re
from collections.abc import Iterator

import pytest

from specdec import SamplingParams
from specdec.llm import ChatOptions
from specdec.serving import ServerConfig
from specdec.serving.reasoning import ReasoningStream, prompt_opens, split

from .conftest import MODEL
from .test_tools import CALL_TEXT, TOOLS

CHAT = [{"role": "user", "content": "Why is the sky blue?"}]
# DeepSeek-R1's way: the template opens the thinking block, the reply starts inside it
OPENING = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: <think>\n{% endif %}"
)
REPLIES = [
    "<think>abc</think>xyz", "abc</think>xyz", "  <think>\nhmm</think>\n\nAnswer", "no tags",
    "<think>cut off", "<thi", "", "<think></think>", "</think>after", "a</thi",
    "<think>x</think>y</think>z", "<<think>", "<think><</think>>", "</think",
]  # fmt: skip


def streamed(text: str, pieces: list[str], opened: bool) -> tuple[str | None, str | None]:
    stream = ReasoningStream(opened)
    reasoning = content = ""
    for piece in pieces:
        more_reasoning, more_content = stream.feed(piece)
        reasoning, content = reasoning + more_reasoning, content + more_content
    more_reasoning, more_content = stream.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return (reasoning, content or None) if stream.thought else (None, content)


@pytest.mark.parametrize("opened", [False, True])
def test_a_stream_splits_as_the_whole_reply_whatever_the_chunks(opened):
    rng = random.Random(0)
    for text in REPLIES:
        whole = split(text, opened)
        chunkings = [[text[:k], text[k:]] for k in range(len(text) + 1)]
        chunkings.append(list(text))  # a character at a time
        for _ in range(30):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
            chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
        for pieces in chunkings:
            assert streamed(text, pieces, opened) == whole, (text, pieces)


def test_the_split_of_a_whole_reply():
    assert split("<think>abc</think>xyz", False) == ("abc", "xyz")
    assert split("  <think>\nhmm</think>\n\nok", False) == ("\nhmm", "\n\nok")
    assert split("abc</think>xyz", True) == ("abc", "xyz")  # the prompt opened the block
    assert split("abc</think>xyz", False) == (None, "abc</think>xyz")  # never opened
    assert split("still thinking", True) == ("still thinking", None)  # cut off inside it
    assert split("<think>x</think>", False) == ("x", None)
    assert split("plain", False) == (None, "plain")
    assert prompt_opens("user: hi\nassistant: <think>\n")
    assert not prompt_opens("<think>\n\n</think>\n\nassistant:")  # Qwen3, thinking disabled
    assert not prompt_opens("user: what is <think>?\nassistant:")  # only the end counts


def parsing_server(**config):  # noqa: ANN003, ANN201
    from .conftest import start_server

    return start_server(
        ServerConfig(served_model_name=MODEL, reasoning_parser="deepseek_r1", **config)
    )


@pytest.fixture(scope="module")
def opening_served():
    """A server splitting replies, whose chat template opens the thinking block."""
    served = parsing_server(chat_template=OPENING)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def parsed_served():
    """A server splitting replies, whose chat template opens no block (the reply may), and
    reading tool calls under "auto"."""
    served = parsing_server(enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield served
    served.stop()


def chat(served, stream: bool, **body) -> tuple[str | None, str | None, dict]:  # noqa: ANN001
    """The reply's reasoning, content and last message or chunk (streamed: joined)."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 0, **body}
    if not stream:
        message = served.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message.get("reasoning") == message.get("reasoning_content")
        return message.get("reasoning"), message["content"], message
    import httpx

    with httpx.stream(
        "POST", served.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30
    ) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    reasoning = "".join(d.get("reasoning") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    return reasoning or None, content or None, {"deltas": deltas}


@contextlib.contextmanager
def scripted(served, text: str) -> Iterator[None]:  # noqa: ANN001
    """Every reply's text is ``text`` (one character a token, the rest with the last, which
    ends it with "stop"): the engine runs as ever, only the text of its deltas is replaced, so
    that a random model "writes" a thinking block for the splits to read."""
    engine, given = served.llm.engine, {}
    real = engine.step

    def step() -> list:
        deltas = []
        for delta in real():
            at = given.get(delta.request_id, 0)
            given[delta.request_id] = at + len(delta.token_ids)
            piece = text[at:] if delta.finished else text[at : at + len(delta.token_ids)]
            reason = "stop" if delta.finished else None
            deltas.append(dataclasses.replace(delta, text=piece, finish_reason=reason))
        return deltas

    engine.step = step
    try:
        yield
    finally:
        del engine.step


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_in_an_opened_block_is_reasoning_until_it_closes(opening_served, offline, stream):
    prompt = offline.render_chat(CHAT, ChatOptions(chat_template=OPENING))
    plain = offline.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0].text
    assert "</think>" not in plain  # the random model never closes it: all reasoning
    reasoning, content, _ = chat(opening_served, stream)
    assert (reasoning, content) == (plain, None)
    reasoning, content, last = chat(opening_served, stream, include_reasoning=False)
    assert (reasoning, content) == (None, None)
    if not stream:
        assert "reasoning" not in last and "reasoning_content" not in last


@pytest.mark.parametrize("stream", [False, True])
def test_a_block_the_reply_opens_and_closes_splits(parsed_served, stream):
    text = "<think>plan it</think>The answer."
    with scripted(parsed_served, text):
        got = chat(parsed_served, stream, max_tokens=len(text) + 4)
    assert got[:2] == ("plan it", "The answer.")


def sent_params(served, monkeypatch, **body):  # noqa: ANN001, ANN003, ANN201
    """The SamplingParams a chat request puts on the engine."""
    added: list = []
    real = served.state.engine.add

    async def add(requests, queue):  # noqa: ANN001, ANN202
        added.extend(requests)
        return await real(requests, queue)

    with monkeypatch.context() as patch:
        patch.setattr(served.state.engine, "add", add)
        chat(served, False, **body)
    return added[0].params


def test_guided_requests_think_first(parsed_served, opening_served, monkeypatch):
    """A guided request's guide waits for ``</think>`` (vLLM's reasoning-aware structured
    outputs): at once under a prompt that opens the block, else once the reply opens one
    itself (the DFA: tests/test_guide_after.py)."""
    guided = {"structured_outputs": {"regex": "[a-z]{6}"}}
    for served, opening in ((opening_served, None), (parsed_served, "<think>")):
        params = sent_params(served, monkeypatch, **guided)
        assert (params.guide_after, params.guide_after_opening) == ("</think>", opening)
        assert sent_params(served, monkeypatch).guide_after is None  # no guide, nothing to wait
    free = chat(parsed_served, False, **guided)
    assert free[0] is None and re.fullmatch("[a-z]{6}", free[1] or "")  # never opened: guided


@pytest.mark.parametrize("stream", [False, True])
def test_a_guide_starts_after_an_opened_block_closes(opening_served, offline, stream):
    """vLLM's reasoning-aware structured outputs: the thinking is free (the random model never
    closes it, so the reply is the unguided one, all reasoning), the guide waits for
    ``</think>`` (its effect after it: tests/test_guide_after.py)."""
    prompt = offline.render_chat(CHAT, ChatOptions(chat_template=OPENING))
    plain = offline.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0].text
    for guide in ({"regex": "[a-z]{6}"}, {"choice": ["yes", "no"]}):
        got = chat(opening_served, stream, structured_outputs=guide)
        assert got[:2] == (plain, None)


@pytest.mark.parametrize("stream", [False, True])
def test_calls_are_read_from_the_content(parsed_served, stream):
    text = "<think>call it</think>" + CALL_TEXT
    with scripted(parsed_served, text):
        reasoning, content, last = chat(parsed_served, stream, tools=TOOLS, max_tokens=len(text))
    assert reasoning == "call it" and content == "Let me look."
    calls = last["tool_calls"] if not stream else [
        t for d in last["deltas"] for t in d.get("tool_calls") or []
    ]  # fmt: skip
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"unit": "c"})
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_keep_the_thinking_before_them(opening_served, stream):
    text = 'weigh it</think>[{"name": "weather", "parameters": {"unit": "c"}}]'
    body = {"tools": TOOLS, "tool_choice": "required", "max_tokens": len(text)}
    with scripted(opening_served, text):
        reasoning, content, last = chat(opening_served, stream, **body)
    assert reasoning == "weigh it" and not content
    calls = last["tool_calls"] if not stream else [
        t for d in last["deltas"] for t in d.get("tool_calls") or []
    ]  # fmt: skip
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"unit": "c"})
    ]


def test_without_a_parser_or_an_opened_block_the_reply_is_content(make_server, served):
    reasoning, content, message = chat(served, False)  # no parser: no split, no fields
    assert reasoning is None and content and "reasoning" not in message
    parsed = make_server(ServerConfig(served_model_name=MODEL, reasoning_parser="qwen3"))
    again = chat(parsed, False)  # the tiny template opens no block, the reply none
    assert again[:2] == (None, content)


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        ServerConfig(reasoning_parser="r1")


@pytest.mark.parametrize("stream", [False, True])
def test_the_responses_api_gives_the_thinking_as_a_reasoning_item(
    parsed_served, opening_served, stream
):
    text = "<think>plan it</think>The answer."
    body = {"model": MODEL, "input": "Why?", "max_output_tokens": len(text), "temperature": 0}
    client = parsed_served.client()
    with scripted(parsed_served, text):
        events = list(client.responses.create(**body, stream=True))  # type: ignore[call-overload]
        whole = client.responses.create(**body)  # type: ignore[call-overload]
    if stream:
        assert [e.sequence_number for e in events] == list(range(len(events)))
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert (thought, said) == ("plan it", "The answer.")
        added = [e.output_index for e in events if e.type == "response.output_item.added"]
        assert added == [0, 1]
        out = events[-1].response
    else:
        out = whole
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == "plan it" and out.output_text == "The answer."
    cut = opening_served.client().responses.create(model=MODEL, input="Why?", max_output_tokens=8)
    assert [item.type for item in cut.output] == ["reasoning"]  # cut off while thinking
    assert cut.status == "incomplete" and cut.output_text == ""
