"""Bad input, limits and failures: a 4xx/5xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from specdec.serving import ServerConfig
from specdec.serving.soak import scrape

from .conftest import MODEL

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = [
    # (path, body: dict or raw text, status, message fragment, param)
    (C, '{"prompt": "x",', 400, "Malformed JSON body", None),
    (C, "[1, 2]", 400, "must be a JSON object", None),
    (C, "", 400, "request body is empty", None),
    (C, '{"prompt": "x", "temperature": NaN}', 400, "temperature: Input should be a finite", "temperature"),
    (C, {"max_tokens": 3}, 400, "prompt: Field required", "prompt"),
    (CHAT, {"model": MODEL}, 400, "messages: Field required", "messages"),
    (C, {"prompt": "x", "max_tokens": "ten"}, 400, 'max_tokens: Input should be a valid integer (got "ten")', "max_tokens"),
    (C, {"prompt": "x", "max_tokens": True}, 400, "max_tokens: Input should be a valid integer", "max_tokens"),
    (C, {"prompt": 5}, 400, "prompt: must be a string, a list of strings", "prompt"),
    (C, {"prompt": []}, 400, "prompt: must not be empty", "prompt"),
    (C, {"prompt": "x", "stop": 3}, 400, "stop: must be a string or a list of strings", "stop"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream: Input should be a valid boolean", "stream"),
    (CHAT, {"messages": "hi"}, 400, "messages: Input should be a valid list", "messages"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role: Field required", "messages[0].role"),
    (C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens: Input should be greater than or equal to 0", "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens may be 0 only with echo set to true", "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens: Input should be greater than or equal to 1", "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens is too large: the context holds 512 tokens and the prompt has 1", "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 600}, 400, "max_completion_tokens is too large", "max_completion_tokens"),
    (C, {"prompt": "x", "temperature": -0.5}, 400, "temperature: Input should be greater than or equal to 0", "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p: Input should be greater than 0", "top_p"),
    (C, {"prompt": "x", "n": 0}, 400, "n: Input should be greater than or equal to 1", "n"),
    (C, {"prompt": "x", "n": 1000}, 400, "n: Input should be less than or equal to 128", "n"),
    (C, {"prompt": "x", "seed": 2**70}, 400, "seed: Input should be less than", "seed"),
    (C, {"prompt": "x", "num_speculative_tokens": -1}, 400, "num_speculative_tokens: Input should be greater than or equal to 0", "num_speculative_tokens"),
    (C, {"prompt": "x", "model": "gpt-4o"}, 404, "The model `gpt-4o` does not exist", "model"),
    (C, {"prompt": "x" * 600}, 400, "prompt has 600 tokens, but the context holds at most 512", "prompt"),
    (C, {"prompt": ""}, 400, "prompt is empty", "prompt"),
    (C, {"prompt": [299, 99999]}, 400, "prompt token ids must lie in [0, 300)", "prompt"),
    (CHAT, {"messages": []}, 400, "messages: must contain at least one message", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "only text content parts are supported, got 'image_url'", "messages[0].content"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs: needs logprobs set to true (got 2)", "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": 1}, 400, "logprobs: Input should be a valid boolean", "logprobs"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs: Input should be less than or equal to 20", "logprobs"),
    (C, {"prompt": "x", "logprobs": True}, 400, "logprobs: Input should be a valid integer", "logprobs"),
    (C, {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias: keys must be token ids", "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias: biases must lie in [-100, 100]", "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"300": 1}}, 400, "logit_bias token ids must lie in [0, 300)", "logit_bias"),
    (C, {"prompt": "x", "stop_token_ids": [300], "min_tokens": 2}, 400, "stop_token_ids token ids must lie in [0, 300)", "stop_token_ids"),
    (C, {"prompt": "x", "allowed_token_ids": [5, 300]}, 400, "allowed_token_ids token ids must lie in [0, 300)", "allowed_token_ids"),
    (C, {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens: must be -1 (as many as fit)", "truncate_prompt_tokens"),
    (C, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids must be a non-empty list", "allowed_token_ids"),
    (CHAT, {"messages": MSG, "bad_words": ["ok", " "]}, 400, "bad_words must be a list of non-blank strings", "bad_words"),
    (C, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty: Input should be less than or equal to 2", "presence_penalty"),
    (CHAT, {"messages": MSG, "frequency_penalty": -3}, 400, "frequency_penalty: Input should be greater than or equal to -2", "frequency_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty: Input should be greater than 0", "repetition_penalty"),
    (C, {"prompt": "x", "echo": 1}, 400, "echo: Input should be a valid boolean", "echo"),
    (C, {"prompt": "x", "best_of": 2}, 400, "best_of: is not supported", "best_of"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0].function: Field required", "tools[0].function"),
    (C, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs: Input should be less than or equal to 20", "prompt_logprobs"),
    (C, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs is not available when stream is true", "prompt_logprobs"),
    (CHAT, {"messages": MSG, "prompt_logprobs": 0, "stream": True}, 400, "prompt_logprobs is not available when stream is true", "prompt_logprobs"),
    (CHAT, {"messages": MSG, "continue_final_message": True}, 400, "continue_final_message: needs add_generation_prompt set to false", "continue_final_message"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs: may not set apply_chat_template's own tokenize", "chat_template_kwargs"),
    (CHAT, {"messages": MSG, "echo": "yes"}, 400, "echo: Input should be a valid boolean", "echo"),
    (C, {"prompt": "x", "guided_choice": []}, 400, "guided_choice: must be a non-empty list of non-empty strings", "guided_choice"),
    (C, {"prompt": "x", "guided_choice": ["a"], "ignore_eos": True}, 400, "choice ends the output where it is complete: leave ignore_eos and min_tokens unset", "guided_choice"),
    (C, {"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}, 400, 'structural_tag: needs "format", or "structures" and "triggers"', "structured_outputs"),
    (C, {"prompt": "x", "structured_outputs": {"structural_tag": 3}}, 400, "structured_outputs: structural_tag must be its JSON text (or an object)", "structured_outputs"),
    (C, {"prompt": "x", "structured_outputs": {"sql": "x"}}, 400, "structured_outputs: sql is not supported by this server; use one of choice, regex, json, grammar, structural_tag, json_object", "structured_outputs"),
    (CHAT, {"messages": MSG, "response_format": {"type": "structural_tag", "triggers": ["<f="], "structures": [{"begin": "<g>", "schema": {}, "end": "</g>"}]}}, 400, "structural_tag.structures[0].begin: must start with exactly one trigger; '<g>' starts with none", "response_format"),
    (C, {"prompt": "x", "structured_outputs": {"grammar": 3}}, 400, "structured_outputs: grammar must be a string", "structured_outputs"),
    (C, {"prompt": "x", "structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, 400, "apply to a JSON guide only", "structured_outputs"),
    (C, {"prompt": "x", "structured_outputs": {"json": {}, "disable_any_whitespace": "yes"}}, 400, "disable_any_whitespace must be true or false", "structured_outputs"),
    (C, {"prompt": "x", "guided_json": {}, "guided_whitespace_pattern": "(?=a)"}, 400, "lookarounds", "guided_json"),
    (C, {"prompt": "x", "structured_outputs": {"regex": "a", "json": {}}}, 400, "give one kind, not regex, json", "structured_outputs"),
    (C, {"prompt": "x", "guided_regex": "a", "guided_json": {}}, 400, "give one of guided_regex and guided_json, not both", "guided_json"),
    (C, {"prompt": "x", "guided_regex": "(?=a)"}, 400, "regex '(?=a)': lookarounds, flags and named groups are not supported", "guided_regex"),
    (C, {"prompt": "x", "guided_json": {"type": "integer", "multipleOf": 2}}, 400, "json_schema keyword 'multipleOf' is not supported", "guided_json"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}}, 400, "json_schema type 'x' is not a JSON type", "response_format"),
    (C, {"prompt": "x", "structured_outputs": {"regex": "("}, "n": 2}, 400, "missing )", "structured_outputs"),
    (C, {"prompt": "x", "guided_json": 3}, 400, "guided_json: must be a JSON Schema (an object, or its text)", "guided_json"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format: type must be text, json_object, json_schema or structural_tag", "response_format"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, 'json_schema needs {"name": ..., "schema": {...}}', "response_format"),
    (CHAT, {"messages": MSG, "guided_regex": "a", "response_format": {"type": "json_object"}}, 400, "give one of guided_regex and response_format", "response_format"),
    (C, {"prompt": "x", "structured_outputs": {"choice": "a"}}, 400, "structured_outputs: choice must be a non-empty list of non-empty strings", "structured_outputs"),
    (C, {"prompt": "x", "guided_choice": ["a"], "structured_outputs": {"choice": ["b"]}}, 400, "not both", "structured_outputs"),
    (C, {"prompt": "x", "guided_grammar": "root ::= x"}, 400, "grammar: rule 'x' is used but not defined", "guided_grammar"),
    (CHAT, {"messages": MSG, "structured_outputs": {"grammar": "start: /a(?=b)/"}}, 400, "grammar: /a(?=b)/: regex 'a(?=b)': lookarounds", "structured_outputs"),
    (C, {"prompt": "x", "guided_grammar": 'root ::= "a"', "guided_regex": "a"}, 400, "give one of guided_regex and guided_grammar, not both", "guided_grammar"),
    (CHAT, {"messages": MSG, "use_beam_search": True, "early_stopping": "soon"}, 400, "early_stopping", "early_stopping"),
    ("/tokenize", {"prompt": "x", "messages": MSG}, 400, "give exactly one of prompt or messages", "prompt"),
    ("/tokenize", {}, 400, "give exactly one of prompt or messages", "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages must contain at least one message", "messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt: Input should be a valid string", "prompt"),
    ("/detokenize", {"tokens": [1, 300]}, 400, "tokens must be token ids in [0, 300)", "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens: Input should be a valid list", "tokens"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, "The model `gpt-4o` does not exist", "model"),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop must be non-empty strings", "stop"),
    # Lone surrogates: JSON may escape one, but it is not Unicode text (this was a 500).
    (C, '{"prompt": "a \\ud800", "max_tokens": 2}', 400, "prompt: contains a lone UTF-16 surrogate (U+D800) at character 2", "prompt"),
    (C, '{"prompt": ["ok", "\\udfff"]}', 400, "lone UTF-16 surrogate", "prompt"),
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "lone UTF-16 surrogate", "messages[0].content"),
    (CHAT, '{"messages": [{"role": "\\ud800", "content": "x"}]}', 400, "lone UTF-16 surrogate", "messages[0].role"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}', 400, "lone UTF-16 surrogate", "messages[0].content"),
    (C, '{"prompt": "x", "model": "\\ud800"}', 400, "lone UTF-16 surrogate", "model"),
    (C, '{"prompt": "x", "stop": ["\\ud800"]}', 400, "lone UTF-16 surrogate", "stop"),
    # Bodies that are not JSON at all say why (these were "There was an error parsing the body").
    (C, b'{"prompt": "\xff\xfe"}', 400, "The request body is not valid UTF-8: invalid start byte at byte 12", None),
    (C, '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, "The JSON body is nested too deeply", None),
    (C, '{"prompt": "x", "max_tokens": ' + "1" * 5000 + "}", 400, "integers may have at most 4300 digits", None),
    # Stop lists the server does not take, and prompts too long to be worth tokenizing.
    (C, {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, 400, "stop has 65 entries, but this server takes at most 64", "stop"),
    (C, {"prompt": "x", "stop_token_ids": list(range(65))}, 400, "stop_token_ids has 65 entries", "stop_token_ids"),
    (C, {"prompt": "x", "stop": ["y" * 257]}, 400, "stop has a string of 257 characters, but this server takes stop strings of at most 256", "stop"),
    (C, {"prompt": "x" * 5000}, 400, "The prompt is too long: 5000 characters cannot fit the context of 512 tokens", "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 5000}]}, 400, "The messages is too long", "messages"),
]  # fmt: skip


def assert_error(response: httpx.Response, status: int, fragment: str, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"], error["message"]
    assert error["param"] == param
    return error


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def assert_still_serving(served) -> None:
    response = served.post(C, json={"prompt": "still there?", "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(("path", "body", "status", "fragment", "param"), BAD_REQUESTS)
def test_bad_request_gets_a_precise_error_and_the_server_goes_on(
    served, path, body, status, fragment, param
):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    response = served.post(path, content=content, headers={"content-type": "application/json"})
    assert_error(response, status, fragment, param)
    assert_still_serving(served)


def test_body_without_json_content_type_and_unknown_routes(served):
    form = served.post(C, content='{"prompt": "x"}')  # what `curl -d` sends
    assert_error(form, 400, "Content-Type: application/json")
    assert_error(httpx.get(served.url + "/v2/nothing"), 404, "Unknown route: GET /v2/nothing")
    assert_error(httpx.get(served.url + C), 405, "Method GET is not allowed")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        served.client().chat.completions.create(model="gpt-4o", messages=MSG)
    assert_still_serving(served)


def test_api_key_is_required_on_v1_routes(make_server):
    served = make_server(ServerConfig(served_model_name=MODEL, api_key="s3cret"))
    error = assert_error(served.post(C, json={"prompt": "x"}), 401, "Missing or incorrect API key")
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    wrong = served.post(C, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="nope", max_retries=0).models.list()
    assert served.client().models.list().data[0].id == MODEL
    assert httpx.get(served.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(served.url + "/version").status_code == 200
    for path in ("/tokenize", "/detokenize"):  # the server's tokenizer is behind the key too
        assert served.post(path, json={"prompt": "x", "tokens": [1]}).status_code == 401
    for header in ("bearer s3cret", "BEARER s3cret", "Bearer  s3cret"):  # RFC 7235: any case
        models = httpx.get(served.url + "/v1/models", headers={"Authorization": header})
        assert models.status_code == 200, header
    for header in ("s3cret", "Basic s3cret", "Bearers3cret", "Bearer s3cre"):
        models = httpx.get(served.url + "/v1/models", headers={"Authorization": header})
        assert models.status_code == 401, header
    assert httpx.get(served.url + "/metrics").status_code == 200  # open by default, as in vLLM


def test_docs_are_off_and_the_schema_and_metrics_can_be_put_behind_the_key(make_server):
    open_server = make_server()
    for path in ("/docs", "/redoc", "/openapi.json"):  # /docs would load scripts from a CDN
        assert_error(httpx.get(open_server.url + path), 404, "Unknown route")
    config = ServerConfig(
        served_model_name=MODEL, api_key="k", openapi=True, metrics_require_key=True
    )
    served = make_server(config)
    key = {"Authorization": "Bearer k"}
    for path in ("/openapi.json", "/metrics"):
        assert_error(httpx.get(served.url + path), 401, "Missing or incorrect API key")
        assert httpx.get(served.url + path, headers=key).status_code == 200
    assert "/v1/completions" in httpx.get(served.url + "/openapi.json", headers=key).json()["paths"]
    assert httpx.get(served.url + "/docs", headers=key).status_code == 404
    with pytest.raises(ValueError, match="metrics_require_key needs an api_key"):
        ServerConfig(metrics_require_key=True)


def test_an_unexpected_error_is_a_500_without_the_exception_text(make_server):
    served = make_server()
    encode = served.llm.encode

    def broken(prompt):
        if prompt == "x":
            raise TypeError("secret internals")
        return encode(prompt)

    served.llm.encode = broken  # type: ignore[method-assign]
    with httpx.Client(base_url=served.url, timeout=30) as client:  # one kept-alive connection
        error = assert_error(client.post(C, json={"prompt": "x"}), 500, "Internal server error")
        assert "secret" not in error["message"] and "TypeError" not in error["message"]
        after = client.post(C, json={"prompt": "y", "max_tokens": 2})  # the connection survived
        assert after.status_code == 200
    counted = scrape(served.url)["specdec_http_requests_total{route=/v1/completions,status=500}"]
    assert counted == 1


def test_prompts_are_tokenized_off_the_event_loop_and_hopeless_ones_not_at_all(make_server):
    """Three 4 MB prompts once stalled every stream for 3.6 s while the loop tokenized them."""
    served = make_server()
    encode, threads = served.llm.encode, []

    def recording(prompt):
        threads.append(threading.current_thread().name)
        return encode(prompt)

    served.llm.encode = recording  # type: ignore[method-assign]
    too_long = served.post(C, json={"prompt": "x" * (served.state.max_prompt_chars + 1)})
    assert_error(too_long, 400, "The prompt is too long", "prompt")
    assert threads == []  # refused on its length alone
    assert_still_serving(served)
    chat = served.post(CHAT, json={"messages": MSG, "max_tokens": 2})
    assert chat.status_code == 200
    assert len(threads) == 2 and "uvicorn" not in threads  # the server's loop runs in "uvicorn"


def test_large_bodies_get_413(make_server):
    served = make_server(ServerConfig(served_model_name=MODEL, max_body_bytes=1000))
    assert_error(served.post(C, json={"prompt": "x" * 2000}), 413, "larger than 1000 bytes")

    def chunks():  # no Content-Length: the size is counted as the body arrives
        yield b'{"prompt": "'
        yield b"x" * 2000
        yield b'"}'

    assert_error(served.post(C, content=chunks()), 413, "larger than 1000 bytes")
    assert_still_serving(served)


def test_overload_gets_503_with_retry_after(make_server):
    served = make_server(ServerConfig(served_model_name=MODEL, max_concurrent=2, max_queue=1))
    step = served.llm.engine.step
    served.llm.engine.step = lambda: (time.sleep(0.002), step())[1]  # type: ignore[method-assign]
    long = {"prompt": "x", "max_tokens": 150, "ignore_eos": True}
    assert_error(served.post(C, json={**long, "n": 3}), 400, "has 3 sequences", "n")
    gate, results = served.state.gate, []
    running = [
        threading.Thread(target=lambda: results.append(served.post(C, json=long))),
        threading.Thread(target=lambda: results.append(served.post(C, json={**long, "n": 2}))),
    ]
    running[0].start()
    wait_for(lambda: gate.num_running == 1)
    running[1].start()  # needs 2 of the 2 sequences: waits for the first request
    wait_for(lambda: gate.num_waiting == 1)
    refused = served.post(C, json=long)
    assert_error(refused, 503, "The server is overloaded")
    assert refused.headers["retry-after"] == "1"
    for thread in running:
        thread.join()
    assert [r.status_code for r in results] == [200, 200]
    assert_still_serving(served)


def test_engine_failure_fails_requests_and_health(make_server):
    served = make_server()
    step, calls = served.llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 5:
            raise RuntimeError("boom")
        return step()

    served.llm.engine.step = failing_step  # type: ignore[method-assign]
    body = {"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served.url + C, json=body) as response:
        events = response.read().decode().split("\n\n")
    assert events[-2] == "data: [DONE]"
    message = json.loads(events[-3][6:])["error"]["message"]
    assert "the engine failed (the server logged why)" in message
    assert "boom" not in message  # a 5xx never carries an exception's text
    assert_error(httpx.get(served.url + "/health"), 503, "The engine is not running")
    refused = served.post(C, json={"prompt": "x"})
    assert_error(refused, 503, "the engine is not running")
