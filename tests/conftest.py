"""Shared fixtures: every LLM a test builds is checked for leaked KV blocks afterwards."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch

# Triton chooses its interpreter when first imported (specdec imports it through transformers and
# torch._dynamo), so without CUDA the kernels must be switched to the interpreter before that.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from specdec import LLM  # noqa: E402
from tests.tiny import byte_tokenizer, tiny_model  # noqa: E402


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """Build LLMs on tiny random models; after the test each must have all KV blocks free."""
    built: list[LLM] = []

    def make(
        arch: str = "llama", seed: int = 0, model_overrides: dict | None = None, **options
    ) -> LLM:
        model = tiny_model(arch, seed, **(model_overrides or {}))
        if torch.cuda.is_available():  # a pool sized from free memory would leave the next none
            options.setdefault("num_kv_blocks", 4096)
        llm = LLM(model, tokenizer=byte_tokenizer(), **options)
        llm.hf_model = model  # type: ignore[attr-defined]
        built.append(llm)
        return llm

    yield make
    for llm in built:
        assert not llm.engine.has_unfinished(), "requests left in the engine"
        assert llm.engine.num_free_blocks == llm.engine.num_blocks, "leaked KV blocks"
