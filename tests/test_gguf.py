"""The default model's GGUF file read quantized: the same weights the dequantizing loader gives."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.gguf import read_quantized
from specdec.loader import _default_gguf_path, load_checkpoint
from specdec.models.quant import QuantLinear

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(None)


@pytest.fixture(scope="module")
def quantized(checkpoint):
    config = checkpoint.config
    return read_quantized(
        _default_gguf_path(), config.num_attention_heads, config.num_key_value_heads
    )


def test_q4_1_and_q8_0_tensors_are_read_code_for_code(checkpoint, quantized):
    """Every linear of every layer is Q4_1 and the tied head Q8_0 in this file. Dequantized, they
    are bit for bit the float32 tensors transformers' GGUF loader makes, the q and k rows (which
    llama.cpp permutes) included."""
    layers = checkpoint.config.num_hidden_layers
    assert len(quantized) == 4 * layers + 1  # qkv, o, gate_up and down per layer, and the head
    assert quantized["lm_head"].bits == 8
    assert {w.bits for n, w in quantized.items() if n != "lm_head"} == {4}
    sd = checkpoint.state_dict
    for i in (0, layers - 1):
        p = f"model.layers.{i}."
        qkv = torch.cat([sd[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"])
        gate_up = torch.cat([sd[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up")])
        assert torch.equal(quantized[f"layers.{i}.self_attn.qkv_proj"].dequantize(), qkv)
        assert torch.equal(quantized[f"layers.{i}.mlp.gate_up_proj"].dequantize(), gate_up)
        down = sd[f"{p}mlp.down_proj.weight"]
        assert torch.equal(quantized[f"layers.{i}.mlp.down_proj"].dequantize(), down)
    assert torch.equal(quantized["lm_head"].dequantize(), sd["model.embed_tokens.weight"])


def test_int4_on_the_default_model_runs_the_files_own_codes(quantized):
    llm = LLM(quantization="int4", num_kv_blocks=64)
    model = llm.engine.runner.model
    down = model.layers[0].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.bits == 4
    file_codes = quantized["layers.0.mlp.down_proj"]
    from specdec.kernels.cpu_quant import unpack

    held = unpack(down.packed)
    assert torch.equal(held.codes, file_codes.codes) and torch.equal(held.mins, file_codes.mins)
    text = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=12),
    )[0].text
    assert "Paris" in text


def test_cli_runs_int4_and_the_quantized_self_drafter():
    from click.testing import CliRunner

    from specdec.cli import main

    args = ["generate", "--max-tokens", "12", "--quantization", "int4", "What is 2+2?"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    args = ["generate", "--max-tokens", "12", "--dtype", "bfloat16", "--drafter", "quantized_self"]
    result = CliRunner().invoke(main, [*args, "--stats", "What is 2+2?"])
    assert result.exit_code == 0 and "accept" in result.output.lower(), result.output
    result = CliRunner().invoke(main, ["generate", "--quantization", "int3", "hi"])
    assert (
        result.exit_code == 2
        and "'int3' is not one of 'int8', 'int4', 'w8a8', 'w4a8'" in result.output
    )
