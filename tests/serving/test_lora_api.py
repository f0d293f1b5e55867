"""LoRA adapters served by name (vLLM's --lora-modules): a request's `model` picks the adapter,
outputs equal the offline engine's through the same adapter, /v1/models lists the adapters, and
adapters are loaded and unloaded at run time where allowed; bad adapters and names are refused."""

from __future__ import annotations

import httpx
import pytest
import torch
from click.testing import CliRunner
from fastapi.testclient import TestClient
from peft import LoraConfig, get_peft_model

import specdec.llm
from specdec import LLM, LoRARequest, SamplingParams
from specdec.serving import ServerConfig, cli
from tests.tiny import byte_tokenizer, tiny_model

from .conftest import MODEL, start_server

PROMPT = "hello, hello, hel"
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


def save_adapter(path, seed: int) -> str:  # noqa: ANN001
    """A random PEFT adapter of the served model (tiny_model("llama")), saved at ``path``."""
    model = tiny_model("llama")  # (which seeds torch's generator itself)
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, LoRARequest]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: LoRARequest(name, i + 1, save_adapter(root / name, seed=i + 1))
        for i, name in enumerate(["sql", "poem", "spare"])
    }


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(tiny_model("llama"), tokenizer=byte_tokenizer(), num_kv_blocks=64, enable_lora=True)


@pytest.fixture(scope="module")
def served(adapters):  # noqa: ANN001, ANN201
    config = ServerConfig(
        served_model_name=MODEL,
        lora_modules=[adapters["sql"], adapters["poem"]],
        allow_runtime_lora_updating=True,
    )
    served = start_server(config, enable_lora=True, max_loras=2, max_cpu_loras=3)
    yield served
    served.stop()


def expected(offline: LLM, lora: LoRARequest | None) -> str:
    params = SamplingParams(**GREEDY)
    return offline.generate([PROMPT], params, lora_request=lora)[0].text


def test_models_lists_the_adapters_beside_the_base_model(served, adapters):
    cards = served.client().models.list().data
    assert [c.id for c in cards] == [MODEL, "sql", "poem"]
    assert cards[0].parent is None  # type: ignore[attr-defined]
    assert cards[1].parent == MODEL and cards[1].root == adapters["sql"].path  # type: ignore[attr-defined]
    assert served.client().models.retrieve("poem").parent == MODEL  # type: ignore[attr-defined]


def test_the_model_field_picks_the_adapter(served, offline, adapters):
    client = served.client()
    texts = {}
    for model in (MODEL, "sql", "poem"):
        reply = client.completions.create(model=model, prompt=PROMPT, extra_body=GREEDY)
        assert reply.model == model
        texts[model] = reply.choices[0].text
    assert texts[MODEL] == expected(offline, None)
    assert texts["sql"] == expected(offline, adapters["sql"])
    assert texts["poem"] == expected(offline, adapters["poem"])
    assert len(set(texts.values())) == 3
    chat = [{"role": "user", "content": "hi"}]
    stream = client.chat.completions.create(
        model="sql",
        messages=chat,
        stream=True,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    params = SamplingParams(**GREEDY)
    assert streamed == offline.chat(chat, params, lora_request=adapters["sql"])[0].text
    served.wait_until_idle()


def test_embeddings_through_an_adapter(served, offline, adapters):
    body = served.post("/v1/embeddings", json={"model": "poem", "input": PROMPT}).json()
    assert body["model"] == "poem"
    reference = offline.embed([PROMPT], lora_request=adapters["poem"])[0].outputs.embedding
    assert body["data"][0]["embedding"] == pytest.approx(reference, abs=1e-5)


def test_an_unknown_model_is_404_naming_what_is_served(served):
    response = served.post("/v1/completions", json={"model": "nope", "prompt": PROMPT})
    assert response.status_code == 404
    assert "serves `tiny`, `sql`, `poem`" in response.json()["error"]["message"]


def test_adapters_are_loaded_and_unloaded_at_run_time(served, offline, adapters):
    path = adapters["spare"].path
    loaded = served.post("/v1/load_lora_adapter", json={"lora_name": "spare", "lora_path": path})
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    reply = served.client().completions.create(model="spare", prompt=PROMPT, extra_body=GREEDY)
    assert reply.choices[0].text == expected(offline, adapters["spare"])
    again = served.post("/v1/load_lora_adapter", json={"lora_name": "spare", "lora_path": path})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = served.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
    assert bad.status_code == 400
    assert "adapter_config.json not found" in bad.json()["error"]["message"]
    gone = served.post("/v1/unload_lora_adapter", json={"lora_name": "spare"})
    assert gone.status_code == 200 and "removed successfully" in gone.text
    assert served.post("/v1/completions", json={"model": "spare", "prompt": "a"}).status_code == 404
    missing = served.post("/v1/unload_lora_adapter", json={"lora_name": "spare"})
    assert missing.status_code == 404
    assert [c.id for c in served.client().models.list().data] == [MODEL, "sql", "poem"]
    served.wait_until_idle()
    assert served.llm.engine.list_loras() == {1, 2}  # the unloaded adapter was let go


def test_runtime_updating_is_off_unless_asked_for(make_server):
    served = make_server()
    response = served.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert response.status_code == 404


def test_adapters_that_cannot_be_served_are_refused_at_start(adapters):
    llm = LLM(tiny_model("llama"), tokenizer=byte_tokenizer(), num_kv_blocks=16)
    from specdec.serving import build_app

    with pytest.raises(ValueError, match="need an LLM with enable_lora=True"):
        build_app(llm, ServerConfig(lora_modules=[adapters["sql"]]))
    lora_llm = LLM(
        tiny_model("llama"), tokenizer=byte_tokenizer(), num_kv_blocks=16, enable_lora=True
    )
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        build_app(lora_llm, ServerConfig(lora_modules=[LoRARequest("a", 1, "/nowhere")]))
    with pytest.raises(ValueError, match="has the served model's name"):
        build_app(lora_llm, ServerConfig(MODEL, lora_modules=[LoRARequest(MODEL, 1, "/x")]))
    with pytest.raises(ValueError, match="names of their own"):
        ServerConfig(lora_modules=[adapters["sql"], LoRARequest("sql", 2, "/x")])


def test_serve_takes_lora_modules_in_both_of_vllms_forms(monkeypatch, adapters):
    calls: dict = {}

    def tiny_llm(model, **options):  # noqa: ANN001, ANN202
        calls["llm"] = options
        return real(tiny_model(), tokenizer=byte_tokenizer(), num_kv_blocks=64, enable_lora=True)

    real = specdec.llm.LLM
    monkeypatch.setattr(specdec.llm, "LLM", tiny_llm)
    monkeypatch.setattr(cli.uvicorn, "run", lambda app, **kwargs: calls.update(app=app))
    sql, poem = adapters["sql"].path, adapters["poem"].path
    args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "4"]
    args += [
        "--lora-modules",
        f"sql={sql}",
        "--lora-modules",
        f'{{"name": "poem", "path": "{poem}"}}',
    ]
    result = CliRunner().invoke(cli.serve, [*args, "--served-model-name", MODEL])
    assert result.exit_code == 0, result.output
    options = calls["llm"]
    assert (options["enable_lora"], options["max_loras"], options["max_lora_rank"]) == (True, 2, 8)
    assert options["max_cpu_loras"] == 4
    with TestClient(calls["app"]) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL, "sql", "poem"]
        assert client.post("/v1/load_lora_adapter", json={}).status_code == 404
    runtime = CliRunner().invoke(cli.serve, [], env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert runtime.exit_code == 0, runtime.output
    with TestClient(calls["app"]) as client:
        response = client.post("/v1/load_lora_adapter", json={"lora_name": "s", "lora_path": sql})
        assert response.status_code == 200, response.text
    for bad, message in (
        ("sql", "give name=path"),
        ('{"name": "x"}', "not JSON with name and path"),
    ):
        refused = CliRunner().invoke(cli.serve, ["--lora-modules", bad])
        assert refused.exit_code == 2 and message in refused.output, refused.output
    missing = CliRunner().invoke(cli.serve, ["--lora-modules", "a=/nowhere"])
    assert missing.exit_code == 1 and "adapter_config.json not found" in missing.output


def test_metrics_name_the_adapters_running(served):
    body = {"model": "poem", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
    body["stream"] = True
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # it is running now
        scraped = httpx.get(served.url + "/metrics").text
        for _ in lines:
            pass
    assert 'max_lora="2",running_lora_adapters="poem",waiting_lora_adapters=""' in scraped
    served.wait_until_idle()
    idle = httpx.get(served.url + "/metrics").text
    assert 'running_lora_adapters="",waiting_lora_adapters=""' in idle


def test_serve_passes_draft_lora_to_quantized_self(monkeypatch):
    calls: dict = {}
    real = specdec.llm.LLM
    monkeypatch.setattr(specdec.llm, "LLM", lambda model, **options: calls.update(options) or real(
        tiny_model(), tokenizer=byte_tokenizer(), num_kv_blocks=64
    ))  # fmt: skip
    monkeypatch.setattr(cli.uvicorn, "run", lambda app, **kwargs: None)
    args = ["--enable-lora", "--drafter", "quantized_self", "--draft-lora"]
    assert CliRunner().invoke(cli.serve, args).exit_code == 0
    assert calls["speculative"].options.draft_lora is True
    refused = CliRunner().invoke(cli.serve, ["--drafter", "prompt_lookup", "--draft-lora"])
    assert refused.exit_code == 2 and "has no option 'draft_lora'" in refused.output


def test_the_resolver_serves_an_adapter_found_by_the_requested_name(make_server, offline, tmp_path):
    root = tmp_path / "resolver"
    found = save_adapter(root / "found", seed=7)
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text('{"peft_type": "PROMPT_TUNING"}')
    config = ServerConfig(
        MODEL, allow_runtime_lora_updating=True, lora_resolver_dir=str(root)
    )  # fmt: skip
    served = make_server(config, enable_lora=True, max_loras=2)
    reply = served.post("/v1/completions", json={"model": "found", "prompt": PROMPT, **GREEDY})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected(offline, LoRARequest("found", 9, found))
    assert reply.json()["model"] == "found"
    models = httpx.get(served.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL, "found"]
    for name in ("missing", "..", "found/../found", "../resolver/found"):  # nothing outside root
        reply = served.post("/v1/completions", json={"model": name, "prompt": PROMPT})
        assert reply.status_code == 404, name
    reply = served.post("/v1/completions", json={"model": "broken", "prompt": PROMPT})
    assert reply.status_code == 400 and "peft_type 'PROMPT_TUNING' is not LORA" in reply.text
    with pytest.raises(ValueError, match="lora_resolver_dir needs allow_runtime_lora_updating"):
        ServerConfig(lora_resolver_dir=str(root))
    refused = CliRunner().invoke(cli.serve, [], env={"VLLM_LORA_RESOLVER_CACHE_DIR": str(root)})
    assert refused.exit_code != 0 and "needs allow_runtime_lora_updating" in refused.output
