"""`specdec serve` options and wiring, and the load generator's command line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

import specdec.llm
from specdec.serving import cli, loadgen
from tests.tiny import byte_tokenizer, tiny_model

from .conftest import MODEL


def test_an_unknown_drafter_is_refused_before_loading_anything():
    result = CliRunner().invoke(cli.serve, ["--drafter", "magic"])
    assert result.exit_code == 2
    assert "'magic' is not one of 'none', 'prompt_lookup', 'draft_model'" in result.output


def test_help_documents_the_options():
    result = CliRunner().invoke(cli.serve, ["--help"])
    options = ("--host", "--port", "--api-key", "SPECDEC_API_KEY", "--max-concurrent", "--device")
    for option in (*options, "--gpu-memory-utilization", "--seed"):
        assert option in result.output


@pytest.fixture
def captured_run(monkeypatch) -> dict:
    """Replace LLM with a tiny model and uvicorn.run with a recorder."""
    calls: dict = {}

    def tiny_llm(model, **options):
        calls["llm"] = (model, options)
        return real_llm(tiny_model(), tokenizer=byte_tokenizer(), num_kv_blocks=64)

    real_llm = specdec.llm.LLM
    monkeypatch.setattr(specdec.llm, "LLM", tiny_llm)
    monkeypatch.setattr(cli.uvicorn, "run", lambda app, **kwargs: calls.update(app=app, **kwargs))
    return calls


def test_serve_binds_loopback_and_takes_the_api_key_from_the_environment(captured_run):
    args = ["--served-model-name", MODEL, "--max-num-seqs", "8", "--dtype", "bfloat16"]
    args += ["--no-batch-invariant", "--quantization", "int4", "--device", "cpu"]
    args += ["--gpu-memory-utilization", "0.5", "--seed", "11"]
    result = CliRunner().invoke(cli.serve, args, env={"SPECDEC_API_KEY": "k3y"})
    assert result.exit_code == 0, result.output
    assert (captured_run["host"], captured_run["port"]) == ("127.0.0.1", 8000)
    assert captured_run["llm"] == (
        None,
        {
            "dtype": "bfloat16",
            "quantization": "int4",
            "batch_invariant": False,
            "device": "cpu",
            "cuda_graphs": False,
            "max_num_seqs": 8,
            "max_model_len": None,
            "kv_cache_memory_gb": 1.0,
            "num_kv_blocks": None,
            "block_size": 16,
            "max_num_batched_tokens": 1024,
            "enable_prefix_caching": True,
            "scheduling_policy": "fcfs",
            "pooling_type": "last",
            "gpu_memory_utilization": 0.5,
            "seed": 11,
            "generation_config": "auto",
            "override_generation_config": None,
            "enable_lora": False,
            "max_loras": 1,
            "max_lora_rank": 16,
            "max_cpu_loras": None,
            "speculative": None,
        },
    )
    with TestClient(captured_run["app"]) as client:
        assert client.get("/v1/models").status_code == 401
        models = client.get("/v1/models", headers={"Authorization": "Bearer k3y"})
        assert models.json()["data"][0]["id"] == MODEL


def test_serve_passes_cuda_graphs_on(captured_run):
    result = CliRunner().invoke(cli.serve, ["--device", "cuda", "--cuda-graphs"])
    assert result.exit_code == 0, result.output
    assert captured_run["llm"][1]["cuda_graphs"] is True


def test_serve_passes_the_scheduling_policy_on(captured_run):
    result = CliRunner().invoke(cli.serve, ["--scheduling-policy", "priority"])
    assert result.exit_code == 0, result.output
    assert captured_run["llm"][1]["scheduling_policy"] == "priority"
    bad = CliRunner().invoke(cli.serve, ["--scheduling-policy", "lifo"])
    assert bad.exit_code == 2 and "'lifo' is not one of 'fcfs', 'priority'" in bad.output


def test_serve_passes_the_pooling_type_on(captured_run):
    result = CliRunner().invoke(cli.serve, ["--pooling-type", "mean"])
    assert result.exit_code == 0, result.output
    assert captured_run["llm"][1]["pooling_type"] == "mean"
    bad = CliRunner().invoke(cli.serve, ["--pooling-type", "max"])
    assert bad.exit_code == 2 and "'max' is not one of 'last', 'mean', 'cls'" in bad.output


def test_serve_passes_the_generation_config_on(captured_run):
    args = ["--generation-config", "vllm", "--override-generation-config", '{"top_p": 0.5}']
    result = CliRunner().invoke(cli.serve, args)
    assert result.exit_code == 0, result.output
    options = captured_run["llm"][1]
    assert options["generation_config"] == "vllm"
    assert options["override_generation_config"] == {"top_p": 0.5}
    for bad, message in (("{top_p", "not JSON"), ("[1]", "must be a JSON object")):
        refused = CliRunner().invoke(cli.serve, ["--override-generation-config", bad])
        assert refused.exit_code == 2 and message in refused.output, refused.output


def test_serve_passes_the_engine_sizes_on_under_vllms_names_too(captured_run):
    args = ["--num-gpu-blocks-override", "300", "--block-size", "32"]
    args += ["--max-num-batched-tokens", "256", "--no-enable-prefix-caching"]
    result = CliRunner().invoke(cli.serve, args)
    assert result.exit_code == 0, result.output
    options = captured_run["llm"][1]
    assert (options["num_kv_blocks"], options["block_size"]) == (300, 32)
    assert options["max_num_batched_tokens"] == 256 and options["enable_prefix_caching"] is False
    result = CliRunner().invoke(cli.serve, ["--num-kv-blocks", "12"])
    assert result.exit_code == 0 and captured_run["llm"][1]["num_kv_blocks"] == 12


def test_serve_reads_a_chat_template_file_or_takes_it_inline(captured_run, tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    for value in (str(path), template):
        result = CliRunner().invoke(cli.serve, ["--chat-template", value])
        assert result.exit_code == 0, result.output
        config = captured_run["app"].state.server.config
        assert config.chat_template == template and not config.trust_request_chat_template
    bad = CliRunner().invoke(cli.serve, ["--chat-template", "no/such/file.jinja"])
    assert bad.exit_code == 2 and "neither a file nor a Jinja template" in bad.output


def test_serve_passes_the_draft_quantization_on(captured_run):
    from specdec.drafters import SpecConfig

    args = ["--drafter", "quantized_self", "--draft-quantization", "w8a8", "--lookup-first", "3"]
    result = CliRunner().invoke(cli.serve, args)
    assert result.exit_code == 0, result.output
    expected = SpecConfig("quantized_self", 8, lookup_first=3, draft_quantization="w8a8")
    assert captured_run["llm"][1]["speculative"] == expected
    bad = CliRunner().invoke(
        cli.serve, ["--drafter", "quantized_self", "--draft-quantization", "q2"]
    )
    assert bad.exit_code == 2 and "'q2' is not one of 'int8', 'int4', 'w8a8', 'w4a8'" in bad.output


def test_serve_passes_heads_on_and_refuses_an_option_of_another_drafter(captured_run):
    from specdec.drafters import SpecConfig

    result = CliRunner().invoke(cli.serve, ["--drafter", "eagle", "--heads", "some/dir"])
    assert result.exit_code == 0, result.output
    assert captured_run["llm"][1]["speculative"] == SpecConfig("eagle", 8, heads="some/dir")
    bad = CliRunner().invoke(cli.serve, ["--drafter", "prompt_lookup", "--heads", "some/dir"])
    assert bad.exit_code == 2
    assert "drafter 'prompt_lookup' has no option 'heads'" in bad.output


def test_train_heads_refuses_bad_options_before_loading_anything():
    from specdec.cli import main

    result = CliRunner().invoke(main, ["train-heads", "--kind", "hydra", "--out", "x"])
    assert result.exit_code == 2 and "'hydra' is not one of 'eagle', 'medusa'" in result.output
    result = CliRunner().invoke(
        main, ["train-heads", "--kind", "eagle", "--out", "x", "--max-steps", "0"]
    )
    assert result.exit_code == 1 and "max_steps must be positive" in result.output
    result = CliRunner().invoke(
        main, ["train-heads", "--kind", "eagle", "--out", "x", "--data", "missing.jsonl"]
    )
    assert result.exit_code == 1 and "no training prompts at missing.jsonl" in result.output


def test_serve_warns_when_open_beyond_loopback(captured_run):
    result = CliRunner().invoke(cli.serve, ["--host", "0.0.0.0"])
    assert result.exit_code == 0 and "with no --api-key" in result.output


def test_loadgen_command_prints_figures(served):
    args = ["--url", served.url, "--requests", "8", "--concurrency", "4", "--model", MODEL]
    result = CliRunner().invoke(loadgen.main, args)
    assert result.exit_code == 0, result.output
    assert "8 ok, 0 failed, 0 disconnected" in result.output and "TTFT" in result.output
    as_json = CliRunner().invoke(loadgen.main, [*args, "--json"])
    assert json.loads(as_json.output)["requests_ok"] == 8


def test_serve_takes_auto_tool_choice_with_a_parser(captured_run):
    args = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    result = CliRunner().invoke(cli.serve, args)
    assert result.exit_code == 0, result.output
    config = captured_run["app"].state.server.config
    assert config.enable_auto_tool_choice and config.tool_call_parser == "hermes"
    bad = CliRunner().invoke(cli.serve, ["--enable-auto-tool-choice"])
    assert bad.exit_code != 0
    assert "enable_auto_tool_choice needs a tool_call_parser" in bad.output
    bad = CliRunner().invoke(cli.serve, ["--tool-call-parser", "granite"])
    assert bad.exit_code == 2
    assert "'granite' is not one of 'hermes', 'mistral', 'llama3_json', 'pythonic'" in bad.output


def test_serve_takes_a_reasoning_parser(captured_run):
    result = CliRunner().invoke(cli.serve, ["--reasoning-parser", "deepseek_r1"])
    assert result.exit_code == 0, result.output
    assert captured_run["app"].state.server.config.reasoning_parser == "deepseek_r1"
    bad = CliRunner().invoke(cli.serve, ["--reasoning-parser", "granite"])
    assert bad.exit_code == 2 and "'granite' is not one of 'deepseek_r1', 'qwen3'" in bad.output
