"""Guided mode: grammar-guided decoding (vLLM's ``guided_grammar``) with and without drafters,
and llama.cpp following the same grammars (its GBNF reads them) on the same GGUF file.

    specdec bench --modes guided [--quick] [--dtype bfloat16]

Tasks: ``eval/prompts/guided.jsonl`` (ours): SQL queries, JSON extraction, bullet lists and
labels with a reason, each a prompt and an EBNF grammar. Chat template, greedy, single stream
(one task after another, prompt processing included), each task's ``max_tokens``. Systems: the
engine without speculation, with each drafter, and llama.cpp where ``llama-cpp-python`` is
installed and the model is the default one; each takes its turn after one untimed pass, the order
reversed every round.

Figures: tokens/s and the ratio to the engine without speculation, per category and overall;
acceptance and mean accepted length; how many outputs equal plain decoding's (every drafter's
must); of the outputs that ended (the others ran out of tokens), how many are whole derivations
of the grammar, the text the grammar's DFA accepts (for llama.cpp, a check that both read the
grammar alike).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.eval.bench.systems import PLAIN, EngineSystem, LlamaCpp, Sampling, engine_systems
from specdec.structured.grammar import grammar_regex
from specdec.structured.regex import compile_regex

GUIDED_TASKS = Path(__file__).resolve().parents[1] / "prompts" / "guided.jsonl"
DRAFTERS = ("prompt_lookup", "quantized_self", "quantized_self+lookup")


@dataclass(frozen=True, slots=True)
class GuidedTask:
    category: str
    prompt: str
    grammar: str
    max_tokens: int


def read_tasks(path: str | Path = GUIDED_TASKS) -> list[GuidedTask]:
    with open(path, encoding="utf-8") as f:
        return [GuidedTask(**json.loads(line)) for line in f if line.strip()]


def run_guided(
    dtype: str = "float32",
    rounds: int = 2,
    tasks: list[GuidedTask] | None = None,
    drafters: tuple[str, ...] = DRAFTERS,
    peers: bool = True,
    model: Any = None,  # noqa: ANN401
    tokenizer: Any = None,  # noqa: ANN401
) -> dict[str, Any]:
    """Time each system on ``tasks`` (default: every task of :data:`GUIDED_TASKS`); see the
    module docstring. ``model``: None (the embedded default model), a path, or an in-memory
    model with its ``tokenizer`` (tests)."""
    tasks = tasks or read_tasks()
    options = {} if tokenizer is None else {"tokenizer": tokenizer}
    engines = engine_systems(model, dtype, list(drafters), [8], **options)
    plain = engines[0].llm
    prompts = [plain.apply_chat_template([{"role": "user", "content": t.prompt}]) for t in tasks]
    eos = plain.engine.eos_token_ids
    systems: list[Any] = list(engines)
    notes = []
    if peers and model is None:
        try:
            systems.append(LlamaCpp(eos[0]))
        except ImportError:
            notes.append("llama.cpp skipped: llama-cpp-python is not installed.")

    def one(system: Any, i: int) -> list[int]:  # noqa: ANN401 - an engine or llama.cpp
        prompt, task = prompts[i], tasks[i]
        if isinstance(system, EngineSystem):
            params = Sampling().params(prompt, task.max_tokens, grammar=task.grammar)
            return system.llm.generate([prompt], params)[0].token_ids
        return system.generate(prompt, task.max_tokens, task.grammar)

    outputs = {s.name: [one(s, i) for i in range(len(tasks))] for s in systems}  # untimed
    before = {s.name: _counts(s) for s in engines}
    seconds = {s.name: [0.0] * len(tasks) for s in systems}
    for r in range(rounds):
        for system in systems if r % 2 == 0 else list(reversed(systems)):
            if isinstance(system, EngineSystem):
                system.llm.reset_prefix_cache()
            for i in range(len(tasks)):
                start = time.perf_counter()
                one(system, i)
                seconds[system.name][i] += time.perf_counter() - start
    categories = list(dict.fromkeys(t.category for t in tasks))
    rates: dict[str, dict[str, float]] = {}
    for name, out in outputs.items():
        rows = {"overall": list(range(len(tasks)))}
        rows |= {c: [i for i, t in enumerate(tasks) if t.category == c] for c in categories}
        rates[name] = {
            group: rounds * sum(len(out[i]) for i in idx) / sum(seconds[name][i] for i in idx)
            for group, idx in rows.items()
        }
    dfas = {t.grammar: compile_regex(grammar_regex(t.grammar)) for t in tasks}

    def whole(ids: list[int], task: GuidedTask) -> bool:
        return bool(ids) and ids[-1] in eos and dfas[task.grammar].fullmatch(plain.decode(ids[:-1]))

    speculation = {}
    for system in engines[1:]:
        drafted, accepted, steps = (a - b for a, b in zip(_counts(system), before[system.name]))
        speculation[system.name] = {
            "acceptance_rate": round(accepted / max(1, drafted), 4),
            "mean_accepted_length": round((accepted + steps) / max(1, steps), 3),
        }
    return {
        "tasks": len(tasks),
        "dtype": dtype,
        "rounds": rounds,
        "categories": categories,
        "tokens_per_s": rates,
        "vs_plain": {
            n: {g: rate / rates[PLAIN][g] for g, rate in r.items()} for n, r in rates.items()
        },
        "speculation": speculation,
        "equal_to_plain": {
            n: f"{sum(a == b for a, b in zip(o, outputs[PLAIN]))}/{len(tasks)}"
            for n, o in outputs.items()
        },
        "whole_derivations": {  # of the outputs that ended (the others ran out of tokens)
            n: f"{sum(whole(ids, t) for ids, t in zip(o, tasks))}/{sum(x[-1] in eos for x in o)}"
            for n, o in outputs.items()
        },
        "mismatches": [
            s.name for s in engines if outputs[s.name] != outputs[PLAIN]
        ],  # a drafter changed an output: the run fails
        "notes": notes,
    }


def _counts(system: EngineSystem) -> tuple[int, int, int]:
    stats = system.llm.engine.verifier.stats
    return stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_verify_steps


def markdown(guided: dict[str, Any]) -> str:
    groups = ["overall", *guided["categories"]]
    lines = [
        "| system | " + " | ".join(f"{g} tok/s (vs plain)" for g in groups)
        + " | acceptance | mean accepted length | equal to plain | whole derivations / ended |",
        "|---" * (len(groups) + 5) + "|",
    ]  # fmt: skip
    for name, rates in guided["tokens_per_s"].items():
        cells = [f"{rates[g]:.1f} ({guided['vs_plain'][name][g]:.2f}x)" for g in groups]
        spec = guided["speculation"].get(name, {})
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {spec.get('acceptance_rate', '')} | "
            f"{spec.get('mean_accepted_length', '')} | {guided['equal_to_plain'][name]} | "
            f"{guided['whole_derivations'][name]} |"
        )
    lines.append(
        f"\n{guided['tasks']} grammar-guided tasks (eval/prompts/guided.jsonl), greedy, single "
        f"stream, prompt processing included; engine in {guided['dtype']}; {guided['rounds']} "
        f"timed rounds after one untimed pass each, side by side in this run. "
        + " ".join(guided["notes"])
        + "\n"
    )
    return "\n".join(lines)
