"""Wrap mode: ``specdec.wrap(model).generate`` against the model's own ``generate``.

    specdec bench --modes wrap [--quick] [--draft-model PATH]

One transformers model, loaded once, generates greedily from chat-templated questions at
batch 1 and batch 8 (left padded), through its own ``generate`` and through ``wrap``, each
plain, with prompt lookup (``prompt_lookup_num_tokens=10``) and with an assistant model (the
``--draft-model``, else the target's first four layers with its embeddings and head). The
systems take turns question batch by question batch, after one untimed call each; tokens/s
count the new tokens before each row's end. Resident memory (the process's RSS) is read after
the model's own generate, after ``wrap``, and after every ``wrap`` call: what wrapping adds.
transformers refuses assisted generation above batch 1; those cells say so.
"""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import specdec
from specdec.loader import default_model_dir

BATCH_SIZES = (1, 8)
LOOKUP: dict[str, Any] = {"prompt_lookup_num_tokens": 10}


def resident_mb() -> float:
    """This process's resident memory (VmRSS), in MB; 0 where /proc is not there."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0.0
    match = re.search(r"VmRSS:\s+(\d+)", status)
    return int(match.group(1)) / 1024 if match else 0.0


def truncated_assistant(model: Any, num_layers: int = 4) -> Any:
    """An assistant for this benchmark: ``model``'s first layers, embeddings and head (the
    same tensors, not copies)."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers = min(num_layers, config.num_hidden_layers)
    assistant = type(model)(config).eval()
    kept = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    assistant.load_state_dict(kept, assign=True)
    return assistant


def run_wrap(
    prompts: list[list[dict[str, str]]],
    max_new_tokens: int = 64,
    draft_model: str | None = None,
    rounds: int = 2,
    model: Any = None,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Time every system at each batch size on ``prompts`` (conversations); see the module
    docstring. Returns tokens/s, ratios to the model's own ``generate``, output agreement and
    resident memory. ``model`` and ``tokenizer``: in-memory ones (tests); default: the
    embedded default model, float32."""
    if model is None:
        path = default_model_dir()
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    assistant = (
        AutoModelForCausalLM.from_pretrained(draft_model, dtype=torch.float32).eval()
        if draft_model
        else truncated_assistant(model)
    )
    texts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
        for c in prompts
    ]
    memory: dict[str, float] = {}
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=False)
    model.generate(**_batch(tokenizer, texts[:1]), **kwargs)  # touch every weight once
    memory["model, after its own generate"] = resident_mb()
    fast = specdec.wrap(model, tokenizer)
    memory["after wrap"] = resident_mb()
    systems = {
        "hf": lambda b: model.generate(**b, **kwargs),
        "hf+prompt_lookup": lambda b: model.generate(**b, **kwargs, **LOOKUP),
        "hf+assistant": lambda b: model.generate(**b, **kwargs, assistant_model=assistant),
        "wrap": lambda b: fast.generate(**b, **kwargs),
        "wrap+prompt_lookup": lambda b: fast.generate(**b, **kwargs, **LOOKUP),
        "wrap+assistant": lambda b: fast.generate(**b, **kwargs, assistant_model=assistant),
    }
    results = []
    for batch_size in BATCH_SIZES:
        groups = [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]
        groups = [g for g in groups if len(g) == batch_size] or [texts[:batch_size]]
        results.append(_time_batch(systems, tokenizer, groups, rounds, batch_size))
        memory[f"after wrap at batch {batch_size}"] = resident_mb()
    return {"batches": results, "memory_mb": memory, "max_new_tokens": max_new_tokens}


def _batch(tokenizer: Any, texts: list[str]) -> dict[str, torch.Tensor]:
    return dict(tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False))


def _time_batch(
    systems: dict[str, Any], tokenizer: Any, groups: list[list[str]], rounds: int, batch: int
) -> dict[str, Any]:
    seconds = dict.fromkeys(systems, 0.0)
    tokens = dict.fromkeys(systems, 0)
    refused: dict[str, str] = {}
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in systems}
    for name, run in systems.items():  # one untimed call each; transformers may refuse
        try:
            run(_batch(tokenizer, groups[0]))
        except ValueError as error:
            refused[name] = str(error).split("\n")[0][:120]
    live = [name for name in systems if name not in refused]
    bar = tqdm(total=rounds * len(groups) * len(live), desc=f"wrap, batch {batch}", unit="call")
    for r in range(rounds):
        for i, texts in enumerate(groups):
            encoded = _batch(tokenizer, texts)
            width = encoded["input_ids"].shape[1]
            order = live if (r + i) % 2 == 0 else list(reversed(live))
            for name in order:
                start = time.perf_counter()
                out = systems[name](encoded)
                seconds[name] += time.perf_counter() - start
                tokens[name] += _new_tokens(out[:, width:], tokenizer.pad_token_id)
                if r == 0:
                    outputs[name].append(out[:, width:])
                bar.update()
    bar.close()
    rates = {name: tokens[name] / seconds[name] for name in live}
    base = rates.get("hf")
    return {
        "batch": batch,
        "calls": rounds * len(groups),
        "tokens_per_s": rates,
        "vs_hf": {name: rate / base for name, rate in rates.items()} if base else {},
        "systems": list(systems),
        "equals_hf": {name: _same(outputs[name], outputs["hf"]) for name in live},
        "refused": refused,
    }


def _new_tokens(new: torch.Tensor, pad: int | None) -> int:
    """Generated tokens before each row's padding (a row ends at its first pad after EOS)."""
    if pad is None:
        return new.numel()
    return int(sum(int((row != pad).cumprod(0).sum()) + int((row == pad).any()) for row in new))


def _same(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> str:
    """How many rows equal transformers' (padded widths may differ)."""
    rows = equal = 0
    for a, b in zip(ours, theirs):
        width = min(a.shape[1], b.shape[1])
        for x, y in zip(a, b):
            rows += 1
            equal += bool(torch.equal(x[:width], y[:width]))
    return f"{equal}/{rows}"


def markdown(wrap: dict[str, Any]) -> str:
    names = wrap["batches"][0]["systems"]
    lines = [
        "| batch | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for row in wrap["batches"]:
        cells = []
        for name in names:
            if name in row["refused"]:
                cells.append(f"refused by transformers ({row['refused'][name]})")
                continue
            rate, ratio = row["tokens_per_s"][name], row["vs_hf"].get(name, 0.0)
            cells.append(f"{rate:.1f} tok/s ({ratio:.2f}x), {row['equals_hf'][name]} as hf")
        lines.append(f"| {row['batch']} | " + " | ".join(cells) + " |")
    lines.append(
        f"\nGreedy, {wrap['max_new_tokens']} new tokens at most, ratios to the model's own "
        "`generate` in this run; 'as hf': rows whose new tokens equal transformers'. Resident "
        "memory: " + ", ".join(f"{k} {v:.0f} MB" for k, v in wrap["memory_mb"].items()) + ".\n"
    )
    return "\n".join(lines)
