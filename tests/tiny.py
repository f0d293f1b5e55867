"""Tiny random models and a byte-level tokenizer for unit tests (no download needed)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 300  # 256 byte tokens + specials + spare ids


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: one token per UTF-8 byte, plus <s> and </s>."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return fast


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):  # noqa: ANN201
    """A 2-layer random model; weights are scaled up so that logits are far from ties."""
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=arch != "mistral",
        initializer_range=0.2,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=None, **kwargs))
    elif arch == "qwen3":  # head_dim given: Qwen3's default (128) is not hidden / heads
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kwargs))
    else:
        raise ValueError(arch)
    return model.eval()


def hf_greedy(  # noqa: ANN001
    model, prompt_ids: list[int], max_new_tokens: int, use_cache: bool = True
) -> list[int]:
    """transformers' own greedy generate, one prompt at a time (no padding); ``use_cache=False``
    recomputes every position at each step (its cached steps round differently: where int8
    activations amplify that, only the recomputed reference is stable)."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        min_new_tokens=max_new_tokens,
        use_cache=use_cache,
    )
    return out[0, len(prompt_ids) :].tolist()
