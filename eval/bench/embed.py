"""Embed mode: ``LLM.embed`` against transformers computing the same vectors.

    specdec bench --modes embed [--quick] [--dtype bfloat16]

The dataset's first turns (every category in turn, as they come) are embedded with last-token
pooling, unit length: by the engine (all prompts in one call, batched and chunked as its token
budget says), and by the transformers model of the same weights, float32, through its decoder
without the LM head, one prompt at a time and in left-padded batches of 8 (the last position
is each row's last token). Each system takes its turn after one untimed call, the order
reversed every round; prompts/s and prompt tokens/s are over the timed rounds. The engine's
prefix cache is emptied before each call, so that no round reuses an earlier one's prompts. Agreement is
each engine vector's cosine similarity with transformers' one-at-a-time vector.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.llm import LLM
from specdec.loader import default_model_dir

HF_BATCH = 8


def run_embed(
    texts: list[str],
    dtype: str = "float32",
    rounds: int = 2,
    model: Any = None,  # noqa: ANN401
    tokenizer: Any = None,  # noqa: ANN401
    **engine_options: Any,  # noqa: ANN401
) -> dict[str, Any]:
    """Time each system on ``texts``; see the module docstring. ``model``: a Hugging Face
    directory, or an in-memory model with its ``tokenizer`` (tests); default: the embedded
    default model."""
    if model is None or isinstance(model, str | os.PathLike):  # a Hugging Face directory
        path = default_model_dir() if model is None else model
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    llm = LLM(model, tokenizer=tokenizer, dtype=dtype, **engine_options)
    prompts = [llm.encode(t) for t in texts]
    systems = {
        "hf, one at a time": lambda: [_hf_last(model, tokenizer, [p]) for p in prompts],
        f"hf, batches of {HF_BATCH}": lambda: [
            _hf_last(model, tokenizer, prompts[i : i + HF_BATCH])
            for i in range(0, len(prompts), HF_BATCH)
        ],
        f"LLM.embed ({dtype})": lambda: [torch.tensor(_embed_uncached(llm, prompts))],
    }
    vectors = {name: torch.cat(run()) for name, run in systems.items()}  # untimed first calls
    seconds = dict.fromkeys(systems, 0.0)
    for r in range(rounds):
        for name in systems if r % 2 == 0 else list(reversed(systems)):
            start = time.perf_counter()
            systems[name]()
            seconds[name] += time.perf_counter() - start
    base = "hf, one at a time"
    tokens = sum(len(p) for p in prompts)
    return {
        "prompts": len(prompts),
        "prompt_tokens": tokens,
        "rounds": rounds,
        "dtype": dtype,
        "prompts_per_s": {n: rounds * len(prompts) / s for n, s in seconds.items()},
        "tokens_per_s": {n: rounds * tokens / s for n, s in seconds.items()},
        "vs_hf": {n: seconds[base] / s for n, s in seconds.items()},
        "min_cosine_vs_hf": {
            n: float(torch.nn.functional.cosine_similarity(v, vectors[base]).min())
            for n, v in vectors.items()
        },
    }


def _embed_uncached(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    """``llm.embed(prompts)`` with the prefix cache emptied first: each call computes its
    prompts, as transformers does, not the blocks an earlier round left."""
    llm.reset_prefix_cache()
    return [o.outputs.embedding for o in llm.embed(prompts)]


@torch.inference_mode()
def _hf_last(model: Any, tokenizer: Any, prompts: list[list[int]]) -> torch.Tensor:  # noqa: ANN401
    """transformers' final-norm state at each prompt's last token, unit length ``[B, H]``."""
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    states = model.model(**batch).last_hidden_state[:, -1]  # left padded: every row's last token
    return torch.nn.functional.normalize(states.float(), dim=-1)


def markdown(embed: dict[str, Any]) -> str:
    lines = ["| system | prompts/s | prompt tokens/s | vs hf one at a time | min cosine to hf |"]
    lines.append("|---|---|---|---|---|")
    for name, rate in embed["prompts_per_s"].items():
        lines.append(
            f"| {name} | {rate:.1f} | {embed['tokens_per_s'][name]:.0f} | "
            f"{embed['vs_hf'][name]:.2f}x | {embed['min_cosine_vs_hf'][name]:.6f} |"
        )
    lines.append(
        f"\n{embed['prompts']} prompts ({embed['prompt_tokens']} tokens), last-token pooling, "
        f"unit length; {embed['rounds']} timed rounds after one untimed call each, "
        "side by side in this run; transformers in float32.\n"
    )
    return "\n".join(lines)
