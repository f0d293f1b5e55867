"""The systems ``specdec bench`` compares: the engine with each drafter, ``transformers``
``generate`` (plain and assisted) and llama.cpp, each generating from token ids, greedily or
(``--temperature``) by sampling."""

from __future__ import annotations

import zlib
from array import array
from dataclasses import dataclass, field
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


@dataclass(frozen=True, slots=True)
class Sampling:
    """How every system decodes: greedily (``temperature`` 0), or by sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0  # the run's; each sampled turn's seed is drawn from it and the prompt

    def __post_init__(self) -> None:
        SamplingParams(temperature=self.temperature, top_p=self.top_p)  # the engine's checks

    def params(self, prompt: list[int], max_tokens: int, **extra: Any) -> SamplingParams:
        """The engine's parameters for a turn. A sampled turn's seed is a function of the run's
        seed and the prompt, so that every engine draws the same noise for it: seeded sampling
        gives plain decoding's tokens whatever the drafter, and each drafter's output is checked
        against plain decoding's as it is under greedy decoding."""
        if not self.temperature:
            return SamplingParams(temperature=0, max_tokens=max_tokens, **extra)
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.turn_seed(prompt),
            max_tokens=max_tokens,
            **extra,
        )

    def turn_seed(self, prompt: list[int]) -> int:
        return self.seed + zlib.crc32(array("q", prompt).tobytes())

    def describe(self) -> str:
        if not self.temperature:
            return "greedy"
        return f"sampled at temperature {self.temperature}, top_p {self.top_p}, seeded per turn"


@dataclass(slots=True)
class EngineSystem:
    """The engine, with a drafter or without."""

    name: str
    llm: LLM
    drafter: str | None  # None: plain decoding
    k: int | None
    sampling: Sampling = field(default_factory=Sampling)

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        params = self.sampling.params(prompt, max_tokens)
        return self.llm.generate([prompt], params)[0].token_ids


@dataclass(slots=True)
class HFSystem:
    """``transformers`` ``generate``; ``extra``: its assisted-generation arguments."""

    name: str
    model: Any
    extra: dict[str, Any]
    pad_token_id: int
    sampling: Sampling = field(default_factory=Sampling)

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        sampled: dict[str, Any] = {"do_sample": False}
        if self.sampling.temperature:  # its own sampler, seeded: no top-k (its default is 50)
            torch.manual_seed(self.sampling.turn_seed(prompt))
            sampled = {
                "do_sample": True,
                "temperature": self.sampling.temperature,
                "top_p": self.sampling.top_p,
                "top_k": 0,
            }
        out = self.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_tokens,
            pad_token_id=self.pad_token_id,
            **sampled,
            **self.extra,
        )
        return out[0, len(prompt) :].tolist()


class LlamaCpp:
    """llama.cpp (``llama-cpp-python``, the ``llamacpp`` extra) on the default model's GGUF
    file, fed token ids; it stops at the end-of-sequence token, as the engine does."""

    name = LLAMA_CPP

    def __init__(self, eos_token_id: int | None = None, sampling: Sampling | None = None) -> None:
        from llama_cpp import Llama  # type: ignore[import-not-found]

        from specdec.loader import _default_gguf_path

        threads = torch.get_num_threads()
        self.eos_token_id = eos_token_id
        self.sampling = sampling or Sampling()
        self.model = Llama(
            str(_default_gguf_path()), n_ctx=4096, n_threads=threads, verbose=False, seed=0
        )

    def generate(self, prompt: list[int], max_tokens: int, grammar: str | None = None) -> list[int]:
        """``grammar``: GBNF the output must follow (llama.cpp's grammar sampler)."""
        self.model.reset()
        tokens: list[int] = []
        how: dict[str, Any]  # typed loosely: llama_cpp's stubs, when installed, want per-key types
        if self.sampling.temperature:  # its own sampler, seeded per turn, top_p alone
            self.model.set_seed(self.sampling.turn_seed(prompt) % 2**31)
            how = {"temp": self.sampling.temperature, "top_p": self.sampling.top_p}
            how |= {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0}  # its defaults: 40, 0.05
        else:
            how = {"temp": 0.0, "top_k": 1}
        if grammar is not None:
            from llama_cpp import LlamaGrammar

            how["grammar"] = LlamaGrammar.from_string(grammar, verbose=False)
        for token in self.model.generate(prompt, reset=True, **how):
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
    sampling: Sampling | None = None,
    **engine_options: Any,
) -> list[EngineSystem]:
    """The engine without speculation, then one per (drafter, k); ``adaptive``: whether the
    policy may draft fewer than k (or none) where drafting does not pay."""
    options: dict[str, Any] = {"dtype": dtype, "kv_cache_memory_gb": 0.5, **engine_options}
    sampling = sampling or Sampling()
    systems = [EngineSystem(PLAIN, LLM(model, **options), None, None, sampling)]
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
            llm = LLM(model, **options, speculative=spec)
            systems.append(EngineSystem(name, llm, drafter, k, sampling))
    return systems


def hf_systems(
    llm: LLM, model: Any, draft_model: str | None, sampling: Sampling | None = None
) -> list[HFSystem]:
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
    sampling = sampling or Sampling()
    systems = [
        HFSystem(HF, hf, {}, pad, sampling),
        HFSystem(HF_PROMPT_LOOKUP, hf, {"prompt_lookup_num_tokens": 10}, pad, sampling),
    ]
    if draft_model:
        assistant = AutoModelForCausalLM.from_pretrained(draft_model, dtype=llm.dtype).eval()
        extra = {"assistant_model": assistant}
        systems.append(HFSystem(HF_DRAFT_MODEL, hf, extra, pad, sampling))
    return systems
