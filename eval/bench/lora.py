"""LoRA mode: decoding through LoRA adapters, against the same engine without one and against
transformers running the adapter with PEFT.

    specdec bench --modes lora [--quick] [--dtype bfloat16]

Adapters: rank 16 on every decoder linear, random (``init_lora_weights=False``, so that they
change the output; speed does not depend on the values), written with ``peft`` into the output
directory, as a user's trained adapters would be. On the dataset's first turns (every category
in turn, chat template, greedy, ``max_new_tokens`` each, end of sequence ignored so that every
system makes as many tokens), the systems, each taking its turn after one untimed call, the order
reversed every round:

* the engine without an adapter and through one, single stream (one prompt after another);
* the same two on all prompts at once, and all prompts at once through four adapters in turn
  (``max_loras=4``: every step mixes them);
* transformers ``generate`` on the PEFT model (the adapter unmerged, as PEFT serves it), single
  stream, in float32.

Exactness: the engine's greedy tokens through the adapter against PEFT's on the same prompts.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from specdec.config import SamplingParams
from specdec.llm import LLM
from specdec.loader import default_model_dir
from specdec.lora import LoRARequest

RANK = 16
NUM_ADAPTERS = 4


def run_lora(
    conversations: list[list[dict[str, str]]],
    max_new_tokens: int,
    out: Path,
    dtype: str = "float32",
    rounds: int = 2,
    model: Any = None,  # noqa: ANN401
    tokenizer: Any = None,  # noqa: ANN401
) -> dict[str, Any]:
    """Time each system on ``conversations``; see the module docstring. ``model``: a Hugging
    Face directory, or an in-memory model with its ``tokenizer`` (tests); default: the embedded
    default model."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ValueError("the lora mode needs peft: pip install peft") from e
    if model is None or isinstance(model, str | os.PathLike):
        path = default_model_dir() if model is None else model
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    else:
        base = model
    config = LoraConfig(
        r=RANK, lora_alpha=RANK // 2, target_modules="all-linear", init_lora_weights=False
    )
    adapters, peft_model = [], None
    for i in range(NUM_ADAPTERS):
        torch.manual_seed(i)
        adapted = get_peft_model(copy.deepcopy(base), config).eval()
        adapted.save_pretrained(str(out / f"lora-adapter-{i}"))
        adapters.append(LoRARequest(f"adapter-{i}", i + 1, str(out / f"lora-adapter-{i}")))
        peft_model = peft_model or adapted  # the first is the reference; the others let go
    assert peft_model is not None
    llm = LLM(
        model, tokenizer=tokenizer, dtype=dtype, enable_lora=True, max_loras=NUM_ADAPTERS,
        max_lora_rank=RANK,
    )  # fmt: skip
    prompts = [llm.apply_chat_template(c) for c in conversations]
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
    one = adapters[0]
    mixed = [adapters[i % NUM_ADAPTERS] for i in range(len(prompts))]

    def single(lora: LoRARequest | None) -> list[list[int]]:
        return [llm.generate([p], params, lora_request=lora)[0].token_ids for p in prompts]

    def batch(lora: Any) -> list[list[int]]:  # noqa: ANN401
        return [o.token_ids for o in llm.generate(prompts, params, lora_request=lora)]

    @torch.inference_mode()
    def peft_single() -> list[list[int]]:
        outputs = []
        for p in prompts:
            ids = peft_model.generate(
                torch.tensor([p]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
            outputs.append(ids[0, len(p) :].tolist())
        return outputs

    systems = {
        "engine, no adapter, single stream": lambda: single(None),
        "engine, one adapter, single stream": lambda: single(one),
        f"engine, no adapter, {len(prompts)} at once": lambda: batch(None),
        f"engine, one adapter, {len(prompts)} at once": lambda: batch(one),
        f"engine, {NUM_ADAPTERS} adapters mixed, {len(prompts)} at once": lambda: batch(mixed),
        "transformers + PEFT, single stream (float32)": peft_single,
    }
    tokens = {name: run() for name, run in systems.items()}  # untimed first calls
    seconds = dict.fromkeys(systems, 0.0)
    for r in range(rounds):
        for name in systems if r % 2 == 0 else list(reversed(systems)):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            systems[name]()
            seconds[name] += time.perf_counter() - start
    made = {name: rounds * sum(len(t) for t in out) for name, out in tokens.items()}
    rate = {name: made[name] / seconds[name] for name in systems}
    plain, peft_name = (
        "engine, no adapter, single stream",
        "transformers + PEFT, single stream (float32)",
    )
    engine_tokens = tokens["engine, one adapter, single stream"]
    agree = sum(a == b for a, b in zip(engine_tokens, tokens[peft_name]))
    return {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "rank": RANK,
        "dtype": dtype,
        "rounds": rounds,
        "tokens_per_s": rate,
        "vs_engine_single_stream": {n: rate[n] / rate[plain] for n in systems},
        "vs_peft": {n: rate[n] / rate[peft_name] for n in systems},
        "outputs_equal_to_peft": f"{agree}/{len(prompts)}",
    }


def markdown(lora: dict[str, Any]) -> str:
    lines = [
        "| system | tokens/s | vs engine, no adapter, single stream | vs transformers + PEFT |"
    ]
    lines.append("|---|---|---|---|")
    for name, rate in lora["tokens_per_s"].items():
        lines.append(
            f"| {name} | {rate:.1f} | {lora['vs_engine_single_stream'][name]:.2f}x | "
            f"{lora['vs_peft'][name]:.2f}x |"
        )
    lines.append(
        f"\n{lora['prompts']} prompts, {lora['max_new_tokens']} new tokens each, greedy; random "
        f"rank-{lora['rank']} adapters of every decoder linear; engine in {lora['dtype']}; "
        f"{lora['rounds']} timed rounds after one untimed call each, side by side in this run. "
        f"Engine outputs through the adapter equal to PEFT's (float32 only: bfloat16 rounds "
        f"otherwise): {lora['outputs_equal_to_peft']}.\n"
    )
    return "\n".join(lines)
