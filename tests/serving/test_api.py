"""The API through the real `openai` client: outputs, streaming, usage, models, health, metrics."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import specdec
from specdec import SamplingParams, StructuredOutputsParams
from tests.tiny import byte_tokenizer

from .conftest import MODEL

EXTRA_EOS = {"ignore_eos": True}
CHAT = [{"role": "user", "content": "Name a prime."}]


def test_greedy_completion_matches_offline_generate(served, offline):
    out = served.client().completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0
    )
    expected = offline.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0))
    assert out.choices[0].text == expected[0].text
    assert out.choices[0].finish_reason == expected[0].finish_reason
    assert out.usage.prompt_tokens == len("Once upon a time")  # one token per byte
    assert out.usage.completion_tokens == len(expected[0].token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.model == MODEL and out.id.startswith("cmpl-")


def test_chat_completion_applies_the_chat_template(served, offline):
    out = served.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0
    )
    expected = offline.chat(CHAT, SamplingParams(max_tokens=10, temperature=0))[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(offline.apply_chat_template(CHAT))
    assert out.usage.completion_tokens == len(expected.token_ids)


@pytest.mark.parametrize("chat", [False, True])
def test_greedy_stream_concatenates_to_the_full_response(served, chat):
    client = served.client()
    args = dict(model=MODEL, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    if chat:
        full = client.chat.completions.create(messages=CHAT, **args)
        stream = client.chat.completions.create(
            messages=CHAT, stream=True, stream_options={"include_usage": True}, **args
        )
    else:
        full = client.completions.create(prompt="stream me", **args)
        stream = client.completions.create(
            prompt="stream me", stream=True, stream_options={"include_usage": True}, **args
        )
    chunks = list(stream)
    texts = [c.choices[0].delta.content if chat else c.choices[0].text for c in chunks[:-1]]
    full_text = full.choices[0].message.content if chat else full.choices[0].text
    assert "".join(t or "" for t in texts) == full_text
    assert len(chunks) > 3 and len({c.id for c in chunks}) == 1
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert full.usage.completion_tokens == 40


def test_stream_is_server_sent_events_ending_in_done(served):
    body = {"prompt": "abc", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = response.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])


def test_n_choices_over_several_prompts(served):
    client = served.client()
    prompts = ["first prompt", "second"]
    greedy = client.completions.create(
        model=MODEL,
        prompt=prompts,
        n=2,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    assert greedy.choices[0].text == greedy.choices[1].text != greedy.choices[2].text
    assert greedy.usage.prompt_tokens == sum(len(p) for p in prompts)  # once per prompt
    assert greedy.usage.completion_tokens == 4 * 6


def test_streamed_choices_are_told_apart_by_index(served):
    args = dict(model=MODEL, messages=CHAT, n=2, max_tokens=8, temperature=1.0, seed=3)
    full = served.client().chat.completions.create(**args)
    texts = ["", ""]
    for chunk in served.client().chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in full.choices]


def test_seeded_sampling_is_reproducible_and_choices_differ(served):
    client = served.client()
    args = dict(model=MODEL, messages=CHAT, n=3, max_tokens=16, temperature=1.0, seed=7)
    first = client.chat.completions.create(**args)
    again = client.chat.completions.create(**args)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) == 3


def test_token_id_prompts_stop_strings_and_extra_fields(served, offline):
    client = served.client()
    by_ids = client.completions.create(
        model=MODEL, prompt=offline.encode("hello"), max_tokens=8, temperature=0
    )
    by_text = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    full = offline.generate("hello", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[
        0
    ]
    stop = full.text[4:6]
    cut = client.completions.create(
        model=MODEL,
        prompt="hello",
        max_tokens=24,
        temperature=0,
        stop=stop,
        extra_body={"top_k": 5, "min_p": 0.1, "num_speculative_tokens": 0, "not_a_field": 1},
    )
    assert cut.choices[0].text == full.text[: full.text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        model=MODEL,
        prompt="hello",
        max_tokens=24,
        temperature=0,
        stop=stop,
        extra_body={"include_stop_str_in_output": True, "skip_special_tokens": False},
    )
    assert kept.choices[0].text == full.text[: full.text.index(stop) + len(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_completed_by_the_last_allowed_token_stops(served, offline, stream):
    """`max_tokens` 7 once returned " red, blue, and green." with `length` for stop ".": the
    last allowed token completed the stop string, and the cut was skipped on finished requests."""
    prompt = [84, 85, 86, 5]  # the tiny model's 19th token here completes a fresh character
    params = SamplingParams(max_tokens=19, temperature=0, ignore_eos=True)
    full = offline.generate([prompt], params)[0]
    stop = full.text[-1]
    assert full.text.index(stop) == len(full.text) - 1
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 19, "temperature": 0, "stop": [stop]}
    body |= {"ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", served.url + "/v1/completions", json=body) as response:
            chunks = [
                json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
            ]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish_reason = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = served.post("/v1/completions", json=body).json()["choices"][0]
        text, finish_reason = choice["text"], choice["finish_reason"]
    assert (text, finish_reason) == (full.text[:-1], "stop")


def test_a_tiny_temperature_is_greedy(served):
    """1e-45 once made the probabilities NaN: token 0 every step, empty text."""
    body = {"model": MODEL, "prompt": "tiny", "max_tokens": 12, "ignore_eos": True}
    greedy = served.post("/v1/completions", json={**body, "temperature": 0}).json()
    tiny = served.post("/v1/completions", json={**body, "temperature": 1e-45}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_max_tokens_defaults_to_the_rest_of_the_context(served):
    max_model_len = served.llm.engine.max_model_len
    prompt = [65] * (max_model_len - 7)
    out = served.client().completions.create(
        model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"


def test_model_may_be_omitted(served):
    response = served.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["model"] == MODEL


def test_models_and_health(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == served.llm.engine.max_model_len  # type: ignore[attr-defined]
    assert served.client().models.retrieve(MODEL).id == MODEL  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        served.client().models.retrieve("gpt-4")
    assert httpx.get(served.url + "/v1/models/org/name").status_code == 404
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    assert httpx.get(served.url + "/version").json() == {"version": specdec.__version__}


def test_metrics_parse_and_count(served):
    served.client().completions.create(model=MODEL, prompt="count me", max_tokens=4, stream=True)
    served.wait_until_idle()
    text = httpx.get(served.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "specdec_http_requests",
        "specdec_prompt_tokens",
        "specdec_generation_tokens",
        "specdec_time_to_first_token_seconds",
        "specdec_inter_token_latency_seconds",
        "specdec_num_requests_waiting",
        "specdec_num_requests_queued",
        "specdec_kv_blocks_used",
        "specdec_spec_decode_num_drafts",
        "specdec_spec_decode_num_draft_tokens",
        "specdec_spec_decode_num_accepted_tokens",
        "specdec_spec_decode_num_accepted_tokens_per_pos",
    ):
        assert name in families, name

    def value(name: str, suffix: str = "", **labels: str) -> float:
        return sum(
            s.value
            for s in families[name].samples
            if s.name == name + suffix and labels.items() <= s.labels.items()
        )

    assert value("specdec_http_requests", "_total", route="/v1/completions", status="200") >= 1
    assert value("specdec_generation_tokens", "_total") >= 4
    assert value("specdec_time_to_first_token_seconds", "_count") >= 1
    assert value("specdec_inter_token_latency_seconds", "_count") >= 3
    assert value("specdec_kv_blocks_used") == 0
    assert value("specdec_kv_blocks_total") == served.llm.engine.num_blocks
    assert value("specdec_spec_decode_num_draft_tokens", "_total") == 0  # no drafter here
    assert families["specdec_spec_decode_num_accepted_tokens_per_pos"].samples == []


def test_speculative_server_streams_plain_decoding_output_and_counts_drafts(make_server):
    """Prompt lookup behind the API: same greedy text, drafts in /metrics, per-request opt-out."""
    plain = make_server()
    spec = make_server(speculative={"drafter": "prompt_lookup", "adaptive": False})
    prompt = "abcabcabcabcabcabc"
    texts = []
    for served in (plain, spec):
        done = served.client().completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0
        )
        texts.append(done.choices[0].text)
    assert texts[0] == texts[1]
    metrics = httpx.get(spec.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    drafted = sum(s.value for s in families["specdec_spec_decode_num_draft_tokens"].samples)
    assert drafted > 0
    off = spec.client().completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"num_speculative_tokens": 0},
    )
    assert off.choices[0].text == texts[0][: len(off.choices[0].text)]


def test_penalties_reach_the_engine(served, offline):
    penalties = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "repetition_penalty": 1.2}
    out = served.client().completions.create(
        model=MODEL,
        prompt="abcabcabc",
        max_tokens=16,
        temperature=0,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        extra_body={"repetition_penalty": 1.2, "ignore_eos": True},
    )
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, **penalties)
    unpenalised = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected, plain = offline.generate(["abcabcabc"] * 2, [params, unpenalised])
    assert out.choices[0].text == expected.text != plain.text


def test_logit_bias_reaches_the_engine(served):
    out = served.client().completions.create(
        model=MODEL, prompt="abc", max_tokens=6, temperature=0, logit_bias={"65": 100}
    )
    assert out.choices[0].text == byte_tokenizer().decode([65]) * 6


def test_tokenize_and_detokenize_as_the_generation_routes_feed_prompts(served, offline):
    text = "Hello, tokens!"
    got = served.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == offline.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == served.llm.engine.max_model_len  # type: ignore[attr-defined]
    assert got["token_strs"] == offline.tokenizer.convert_ids_to_tokens(got["tokens"])
    chat = served.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == offline.apply_chat_template(CHAT) and chat["token_strs"] is None
    usage = served.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert usage.usage.prompt_tokens == chat["count"]
    back = served.post("/detokenize", json={"tokens": got["tokens"], "model": MODEL}).json()
    assert back == {"prompt": text}


def test_chat_continues_a_started_reply_and_echoes_it(served, offline):
    started = CHAT + [{"role": "assistant", "content": "Seven"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    body = {"messages": started, "max_tokens": 6, "temperature": 0, "ignore_eos": True} | fields
    expected = offline.chat(
        started, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        add_generation_prompt=False, continue_final_message=True,
    )[0]  # fmt: skip
    reply = served.post("/v1/chat/completions", json=body).json()
    assert reply["choices"][0]["message"]["content"] == expected.text
    echoed = served.post("/v1/chat/completions", json=body | {"echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "Seven" + expected.text
    assert echoed["usage"] == reply["usage"]
    events = served.post("/v1/chat/completions", json=body | {"echo": True, "stream": True})
    chunks = [json.loads(line[6:]) for line in events.text.splitlines() if line[6:7] == "{"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "Seven" + expected.text
    plain = {"messages": CHAT, "max_tokens": 4, "temperature": 0}  # the last turn is the user's
    for_user = [
        served.post("/v1/chat/completions", json=plain | {"echo": e}) for e in (False, True)
    ]
    assert len({r.json()["choices"][0]["message"]["content"] for r in for_user}) == 1
    tokens = served.post("/tokenize", json={"messages": started} | fields).json()["tokens"]
    assert tokens == expected.prompt_token_ids


def test_guided_choice_as_vllm_takes_it(served, offline):
    choices = ["red", "green", "blue"]
    params = SamplingParams(temperature=0, max_tokens=8, choice=choices)
    expected = offline.chat(CHAT, params)[0]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        reply = served.client().chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=8, temperature=0, extra_body=extra
        )
        assert reply.choices[0].message.content == expected.text
        assert reply.choices[0].finish_reason == "stop"
    sampled = served.client().completions.create(
        model=MODEL,
        prompt="Pick:",
        max_tokens=8,
        n=6,
        seed=1,
        extra_body={"guided_choice": choices},
    )
    assert all(c.text.rstrip("#") in choices for c in sampled.choices)  # "#": an EOS id of tiny


GRAMMAR = 'root ::= [a-c]{2} ("-" digits)+\ndigits ::= [0-9] | [0-9] digits'


def test_guided_regex_json_and_grammar_as_vllm_and_openai_take_them(served, offline):
    """Every field that names a guide gives the offline engine's output under that guide."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    cases = [
        ({"regex": "[a-c]{2}[0-9]+"}, [{"guided_regex": "[a-c]{2}[0-9]+"},
                                       {"structured_outputs": {"regex": "[a-c]{2}[0-9]+"}}]),
        ({"json_schema": schema}, [{"guided_json": schema}, {"structured_outputs": {"json": schema}},
                                   {"response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "n", "schema": schema}}}]),
        ({"json_schema": {"type": "object"}}, [{"structured_outputs": {"json_object": True}},
                                               {"response_format": {"type": "json_object"}}]),
        ({"grammar": GRAMMAR}, [{"guided_grammar": GRAMMAR},
                                {"structured_outputs": {"grammar": GRAMMAR}}]),
        ({"structured_outputs": StructuredOutputsParams(json=schema, disable_any_whitespace=True)},
         [{"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
          {"guided_json": schema, "guided_whitespace_pattern": ""},
          {"guided_json": schema, "structured_outputs": {"disable_any_whitespace": True}}]),
    ]  # fmt: skip
    for guide, bodies in cases:
        params = SamplingParams(temperature=0, max_tokens=24, **guide)
        expected = offline.chat(CHAT, params)[0]
        for extra in bodies:
            body = {"messages": CHAT, "max_tokens": 24, "temperature": 0} | extra
            reply = served.post("/v1/chat/completions", json=body).json()
            assert reply["choices"][0]["message"]["content"] == expected.text, extra
    expected = offline.generate("Pick:", SamplingParams(temperature=0, max_tokens=24,
                                                        json_schema=schema))[0]  # fmt: skip
    for extra in ({"guided_json": schema}, {"response_format": {  # vLLM's completions take both
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}):  # fmt: skip
        body = {"prompt": "Pick:", "max_tokens": 24, "temperature": 0} | extra
        reply = served.post("/v1/completions", json=body).json()
        assert reply["choices"][0]["text"] == expected.text, extra
    sampled = served.client().completions.create(
        model=MODEL, prompt="Pick:", max_tokens=40, n=4, seed=3,
        extra_body={"guided_json": schema},
    )  # fmt: skip
    ended = [c for c in sampled.choices if c.finish_reason == "stop"]
    assert ended  # seeded: some samples end within 40 tokens, each a document the schema takes
    for choice in ended:  # "#": an EOS id of the tiny tokenizer
        assert isinstance(json.loads(choice.text.rstrip("#"))["n"], int)
