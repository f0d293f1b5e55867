"""A LoRA adapter on the embedded default model: greedy output equals PEFT's own model, beside
base-model requests in the same steps; bf16 speculation through it changes no token."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from specdec import LLM, LoRARequest, SamplingParams
from specdec.loader import default_model_dir

pytestmark = pytest.mark.integration

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=20)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):  # noqa: ANN201
    """A random rank-8 adapter of every decoder linear (B not zero, as after training) and the
    PEFT model that applies it, the reference."""
    base = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(base), config).eval()
    path = tmp_path_factory.mktemp("lora") / "adapter"
    peft_model.save_pretrained(str(path))
    return LoRARequest("random", 1, str(path)), peft_model, base


def test_adapter_greedy_matches_peft_beside_base_requests(adapter):
    lora, peft_model, base = adapter
    llm = LLM(enable_lora=True, num_kv_blocks=64)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outputs = llm.generate(prompts * 2, GREEDY, lora_request=[lora] * 3 + [None] * 3)
    for i, ids in enumerate(prompts):
        for model, out in ((peft_model, outputs[i]), (base, outputs[i + 3])):
            with torch.no_grad():
                ref = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
            assert out.token_ids == ref[0, len(ids) :].tolist()
    assert [o.token_ids for o in outputs[:3]] != [o.token_ids for o in outputs[3:]]


def test_bf16_speculation_through_an_adapter_is_exact(adapter):
    lora = adapter[0]
    plain = LLM(dtype="bfloat16", enable_lora=True, num_kv_blocks=64)
    spec = LLM(
        dtype="bfloat16",
        enable_lora=True,
        num_kv_blocks=64,
        speculative={"drafter": "prompt_lookup", "num_speculative_tokens": 4, "adaptive": False},
    )
    text = "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the"
    prompts = [
        plain.apply_chat_template([{"role": "user", "content": q}]) for q in [text, *QUESTIONS]
    ]
    expected = plain.generate(prompts, GREEDY, lora_request=lora)
    got = spec.generate(prompts, GREEDY, lora_request=lora)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert spec.engine.verifier.stats.num_accepted_tokens > 0


def test_cli_generates_through_an_adapter(adapter, tmp_path):
    from click.testing import CliRunner

    from specdec.cli import main

    lora, _, _ = adapter
    question = QUESTIONS[0]
    result = CliRunner().invoke(
        main, ["generate", "--lora", lora.path, "--max-tokens", "12", question]
    )
    assert result.exit_code == 0, result.output
    llm = LLM(enable_lora=True, num_kv_blocks=64)
    expected = llm.chat([{"role": "user", "content": question}], GREEDY, lora_request=lora)[0]
    plain = llm.chat([{"role": "user", "content": question}], GREEDY)[0]
    shown = result.output.split("\n")[1]
    assert expected.text.startswith(shown) and not plain.text.startswith(shown)
    beams = ["generate", "--raw", "--beam-width", "2", "--max-tokens", "8", question]
    through = CliRunner().invoke(main, ["generate", "--lora", lora.path, *beams[1:]])
    assert through.exit_code == 0, through.output
    base = CliRunner().invoke(main, beams)
    assert "[1]" in through.stdout and through.stdout != base.stdout  # the adapter's beams
    result = CliRunner().invoke(main, ["generate", "--lora", str(tmp_path), "hi"])
    assert result.exit_code != 0 and "adapter_config.json not found" in result.output
