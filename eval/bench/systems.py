"""The systems ``specdec bench`` compares: the engine with each drafter, ``transformers``
``generate`` (plain and assisted) and llama.cpp, each generating greedily from token ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdec import LLM, SamplingParams, SpecConfig
from specdec.drafters.heads import default_heads
from specdec.drafters.lookup_first import DEFAULT_LOOKUP_FIRST, LOOKUP_SUFFIX
from specdec.drafters.registry import DRAFTERS

PLAIN = "specdec"  # the engine without speculation: every ratio's baseline
HF = "hf"
HF_PROMPT_LOOKUP = "hf+prompt_lookup"
HF_DRAFT_MODEL = "hf+draft_model"
LLAMA_CPP = "llama.cpp"


@dataclass(slots=True)
class EngineSystem:
    """The engine, with a drafter or without."""

    name: str
    llm: LLM
    drafter: str | None  # None: plain decoding
    k: int | None

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        return self.llm.generate([prompt], params)[0].token_ids


@dataclass(slots=True)
class HFSystem:
    """``transformers`` ``generate``, greedy; ``extra``: its assisted-generation arguments."""

    name: str
    model: Any
    extra: dict[str, Any]
    pad_token_id: int

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        out = self.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=self.pad_token_id,
            **self.extra,
        )
        return out[0, len(prompt) :].tolist()


class LlamaCpp:
    """llama.cpp (``llama-cpp-python``, the ``llamacpp`` extra) on the default model's GGUF
    file, greedy, fed token ids; it stops at the end-of-sequence token, as the engine does."""

    name = LLAMA_CPP

    def __init__(self, eos_token_id: int | None = None) -> None:
        from llama_cpp import Llama  # type: ignore[import-not-found]

        from specdec.loader import _default_gguf_path

        threads = torch.get_num_threads()
        self.eos_token_id = eos_token_id
        self.model = Llama(
            str(_default_gguf_path()), n_ctx=4096, n_threads=threads, verbose=False, seed=0
        )

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        self.model.reset()
        tokens: list[int] = []
        for token in self.model.generate(prompt, temp=0.0, top_k=1, reset=True):
            tokens.append(int(token))
            if len(tokens) == max_tokens or token == self.eos_token_id:
                break
        return tokens


def available_drafters(model: Any, draft_model: str | None, heads: dict[str, str]) -> list[str]:
    """The drafters that can run for ``model`` (None: the default) with what was given: a draft
    model needs one, heads need a directory or shipped heads (the default model's)."""
    names = []
    for name in DRAFTERS:
        if name == "draft_model" and not draft_model:
            continue
        shipped = model is None and (default_heads(name) / "config.json").is_file()
        if name in ("eagle", "medusa") and name not in heads and not shipped:
            continue
        names.append(name)
        if name == "quantized_self":  # and with prompt lookup first (drafters/lookup_first.py)
            names.append(name + LOOKUP_SUFFIX)
    return names


def engine_systems(
    model: Any,
    dtype: str,
    drafters: list[str],
    ks: list[int],
    draft_model: str | None = None,
    heads: dict[str, str] | None = None,
    adaptive: bool = True,
    **engine_options: Any,
) -> list[EngineSystem]:
    """The engine without speculation, then one per (drafter, k); ``adaptive``: whether the
    policy may draft fewer than k (or none) where drafting does not pay."""
    options: dict[str, Any] = {"dtype": dtype, "kv_cache_memory_gb": 0.5, **engine_options}
    systems = [EngineSystem(PLAIN, LLM(model, **options), None, None)]
    for drafter in drafters:
        extra: dict[str, Any] = {}
        base = drafter.removesuffix(LOOKUP_SUFFIX)  # "eagle+lookup": eagle, lookup first
        if base != drafter:
            extra["lookup_first"] = DEFAULT_LOOKUP_FIRST
        if base == "draft_model":
            extra["draft_model"] = draft_model
        if base in (heads or {}):
            extra["heads"] = (heads or {})[base]
        for k in ks:
            name = f"{drafter}" if len(ks) == 1 else f"{drafter} k={k}"
            spec = SpecConfig(base, k, adaptive, **extra)
            systems.append(EngineSystem(name, LLM(model, **options, speculative=spec), drafter, k))
    return systems


def hf_systems(llm: LLM, model: Any, draft_model: str | None) -> list[HFSystem]:
    """``transformers`` ``generate`` on the same checkpoint: plain, with its prompt lookup, and
    with the draft model as its assistant when one is given."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    from specdec.loader import default_model_dir

    if isinstance(model, PreTrainedModel):  # in memory (the tests' tiny models)
        hf = model.eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(model or default_model_dir(), dtype=llm.dtype)
        hf.eval()
    pad = llm.tokenizer.pad_token_id
    pad = pad if pad is not None else llm.tokenizer.eos_token_id or 0
    systems = [
        HFSystem(HF, hf, {}, pad),
        HFSystem(HF_PROMPT_LOOKUP, hf, {"prompt_lookup_num_tokens": 10}, pad),
    ]
    if draft_model:
        assistant = AutoModelForCausalLM.from_pretrained(draft_model, dtype=llm.dtype).eval()
        systems.append(HFSystem(HF_DRAFT_MODEL, hf, {"assistant_model": assistant}, pad))
    return systems
