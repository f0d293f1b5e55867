"""The embedded default model (SmolLM2-135M-Instruct) as specdec.loader reads it: its config,
tokenizer and weights, converted from its GGUF file once into the shared cache (~/.cache/specdec,
or $SPECDEC_CACHE) and reused. Split from tests/test_loader.py, whose unit tests use tiny models.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from specdec import loader
from specdec.loader import LoadedCheckpoint, load_checkpoint


@pytest.fixture(scope="module")
def default_checkpoint() -> LoadedCheckpoint:
    """The default model, from the shared cache (converted here if the cache is empty)."""
    return load_checkpoint()


@pytest.mark.integration
def test_default_model_config_and_cache(
    default_checkpoint: LoadedCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = default_checkpoint.config
    assert type(config) is transformers.LlamaConfig
    assert (config.num_hidden_layers, config.vocab_size, config.hidden_size) == (30, 49152, 576)
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in default_checkpoint.state_dict
    assert default_checkpoint.state_dict["model.embed_tokens.weight"].shape == (49152, 576)
    assert (loader.default_model_dir() / "model.safetensors").is_file()

    def no_conversion(*args: object) -> None:
        raise AssertionError("the cached conversion was not reused")

    monkeypatch.setattr(loader, "_convert_gguf", no_conversion)
    again = load_checkpoint(dtype="bf16")
    embed = default_checkpoint.state_dict["model.embed_tokens.weight"]
    assert torch.equal(again.state_dict["model.embed_tokens.weight"], embed.bfloat16())


@pytest.mark.integration
def test_default_model_tokenizer(default_checkpoint: LoadedCheckpoint) -> None:
    tokenizer = default_checkpoint.tokenizer
    text = "Speculative decoding keeps the target's output: 12345 ✓"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(prompt, str)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.integration
def test_default_model_weights_answer_correctly(default_checkpoint: LoadedCheckpoint) -> None:
    """Wrong q/k row order or a wrong tensor would make the model babble."""
    state_dict = default_checkpoint.state_dict
    model = transformers.LlamaForCausalLM.from_pretrained(
        None, config=default_checkpoint.config, state_dict=state_dict
    )
    loaded = model.state_dict()
    assert all(torch.equal(loaded[key], tensor) for key, tensor in state_dict.items())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = default_checkpoint.tokenizer
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    output = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, ids.shape[1] :])
