"""Server options beside the routes' core: vLLM's stream_options.continuous_usage_stats, and
chat templates of the server's or a trusted request's own."""

from __future__ import annotations

import pytest

from specdec.serving import ServerConfig
from tests.tiny import byte_tokenizer

from .conftest import MODEL
from .test_api import CHAT, EXTRA_EOS


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_count_the_tokens_so_far_in_every_chunk(served, chat):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens sent
    up to it; without include_usage it changes nothing."""
    client = served.client()
    args = dict(model=MODEL, max_tokens=12, temperature=0, stream=True, extra_body=EXTRA_EOS)
    args |= {"messages": CHAT} if chat else {"prompt": "count me"}
    create = client.chat.completions.create if chat else client.completions.create
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(create(stream_options=options, **args))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12 and counts[0] <= 1
    prompt = {c.usage.prompt_tokens for c in chunks}
    assert len(prompt) == 1 and all(
        c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks
    )
    quiet = list(create(stream_options={"continuous_usage_stats": True}, **args))
    assert all(c.usage is None for c in quiet)


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>"


def test_a_servers_chat_template_and_a_trusted_requests_own(make_server):
    """--chat-template replaces the tokenizer's for every route that renders messages; a
    request's own chat_template is refused unless the server trusts requests with one."""
    plain = make_server()
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "max_tokens": 2}
    refused = plain.post("/v1/chat/completions", json={**body, "chat_template": TEMPLATE})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    config = ServerConfig(
        served_model_name=MODEL, chat_template=TEMPLATE, trust_request_chat_template=True
    )
    templated = make_server(config)
    tokens = templated.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert byte_tokenizer().decode(tokens) == "[user] hi\n>"
    reply = templated.post("/v1/chat/completions", json=body).json()
    assert reply["usage"]["prompt_tokens"] == len(tokens)
    own = templated.post("/tokenize", json={"messages": messages, "chat_template": "{{ 'x' }}"})
    assert byte_tokenizer().decode(own.json()["tokens"]) == "x"
