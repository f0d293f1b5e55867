"""Offline mode: single-stream generation of every question by every system, greedy or sampled
(each turn's seed the same on every engine, so seeded sampling is checked as greedy decoding is).

The systems take turns question by question, the order reversed at every question, so drift in
the machine's speed hits all alike. A multi-turn question is played turn by turn, each system's
own answer kept in the history. Each engine with a drafter must produce exactly the tokens of the
engine without one, turn by turn; a difference is recorded as a mismatch, which fails the run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from specdec.eval.bench.lookup import lookup_ceiling, reference_lookup
from specdec.eval.bench.systems import HF, PLAIN, EngineSystem
from specdec.eval.questions import Question

DEFAULT_MAX_TOKENS = 128  # new tokens per turn where neither the run nor the question says
WARM_UP_TEXT = "One two three four five six seven eight. " * 4  # repeats: prompt lookup drafts


@dataclass(slots=True)
class Tally:
    """One system's time and output on one category, and its drafter's counters there."""

    seconds: float = 0.0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)


def _counters(system: Any) -> tuple[int, int, int, list[int], list[int]]:
    s = system.llm.engine.verifier.stats
    return (
        s.num_draft_tokens,
        s.num_accepted_tokens,
        s.num_verify_steps,
        list(s.drafted_per_position),
        list(s.accepted_per_position),
    )


def _minus(after: list[int], before: list[int]) -> list[int]:
    return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]


def play(
    system: Any, chat: Any, question: Question, max_tokens: int
) -> tuple[float, list[list[int]], list[list[int]]]:
    """Play ``question`` on ``system``: (seconds generating, the prompt and the output of each
    turn). ``chat``: an LLM whose tokenizer renders the conversation."""
    history: list[dict[str, str]] = []
    seconds, prompts, outputs = 0.0, [], []
    for turn in question.turns:
        history.append({"role": "user", "content": turn})
        prompt = chat.apply_chat_template(history)
        start = time.perf_counter()
        output = system.generate(prompt, max_tokens)
        seconds += time.perf_counter() - start
        prompts.append(prompt)
        outputs.append(output)
        text = chat.tokenizer.decode(output, skip_special_tokens=True)
        history.append({"role": "assistant", "content": text})
    return seconds, prompts, outputs


def run_offline(
    systems: list[Any],
    groups: dict[str, list[Question]],
    max_new_tokens: int | None = None,
) -> dict[str, Any]:
    """Every question of every category on every system; the figures per category and overall.

    ``systems[0]`` must be the engine without speculation. A question's ``max_tokens`` (else
    ``max_new_tokens``: the new tokens of every turn; None: each question's own ``max_tokens``,
    else ``DEFAULT_MAX_TOKENS``."""
    assert systems[0].name == PLAIN
    chat = systems[0].llm
    warm_up = chat.encode(WARM_UP_TEXT)
    for system in systems:  # warm up: kernels built, first calls made, before anything is timed
        system.generate(warm_up, 8)
    tallies = {c: {s.name: Tally() for s in systems} for c in groups}
    lookup_figures: dict[str, list[int]] = {c: [0, 0, 0, 0] for c in groups}
    mismatches: list[dict[str, Any]] = []
    total = sum(len(qs) for qs in groups.values())
    bar = tqdm(total=total * len(systems), desc="offline", unit="run")
    turn_order = 0
    for category, questions in groups.items():
        before = {
            s.name: _counters(s) for s in systems if isinstance(s, EngineSystem) and s.drafter
        }
        for question in questions:
            max_tokens = max_new_tokens or question.max_tokens or DEFAULT_MAX_TOKENS
            order = systems if turn_order % 2 == 0 else list(reversed(systems))
            turn_order += 1
            played: dict[str, list[list[int]]] = {}
            prompts: list[list[int]] = []
            for system in order:
                seconds, these_prompts, outputs = play(system, chat, question, max_tokens)
                tally = tallies[category][system.name]
                tally.seconds += seconds
                tally.tokens += sum(map(len, outputs))
                played[system.name] = outputs
                if system.name == PLAIN:
                    prompts = these_prompts
                bar.update()
            plain = played[PLAIN]
            for prompt, output in zip(prompts, plain):
                for i, count in enumerate(lookup_ceiling(prompt, output, k=8, n=2)):
                    lookup_figures[category][i] += count
                for i, count in enumerate(reference_lookup(prompt, output)):
                    lookup_figures[category][2 + i] += count
            for system in systems:
                if isinstance(system, EngineSystem) and system.drafter:
                    for turn, (got, want) in enumerate(zip(played[system.name], plain)):
                        if got != want:
                            mismatches.append(
                                _mismatch(system.name, category, question, turn, got, want)
                            )
        for system in systems:
            if system.name in before:
                tally = tallies[category][system.name]
                d0, a0, s0, pd0, pa0 = before[system.name]
                d1, a1, s1, pd1, pa1 = _counters(system)
                tally.drafted, tally.accepted, tally.verify_steps = d1 - d0, a1 - a0, s1 - s0
                tally.drafted_per_position = _minus(pd1, pd0)
                tally.accepted_per_position = _minus(pa1, pa0)
    bar.close()
    categories = {
        c: _figures(tallies[c], systems, lookup_figures[c], len(groups[c])) for c in groups
    }
    overall = _merge(tallies, systems)
    return {
        "systems": [s.name for s in systems],
        "categories": categories,
        "overall": _figures(
            overall, systems, [sum(f[i] for f in lookup_figures.values()) for i in range(4)], total
        ),
        "mismatches": mismatches,
    }


def _mismatch(
    name: str, category: str, question: Question, turn: int, got: list[int], want: list[int]
) -> dict[str, Any]:
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return {
        "system": name,
        "category": category,
        "question_id": question.question_id,
        "turn": turn,
        "first_difference": first,
        "tokens": len(got),
        "plain_tokens": len(want),
    }


def _merge(tallies: dict[str, dict[str, Tally]], systems: list[Any]) -> dict[str, Tally]:
    merged = {s.name: Tally() for s in systems}
    for per_system in tallies.values():
        for name, t in per_system.items():
            m = merged[name]
            m.seconds += t.seconds
            m.tokens += t.tokens
            m.drafted += t.drafted
            m.accepted += t.accepted
            m.verify_steps += t.verify_steps
            for attr in ("drafted_per_position", "accepted_per_position"):
                mine, theirs = getattr(m, attr), getattr(t, attr)
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, v in enumerate(theirs):
                    mine[i] += v
    return merged


def _figures(
    tallies: dict[str, Tally], systems: list[Any], lookup_figures: list[int], questions: int
) -> dict[str, Any]:
    plain = tallies[PLAIN]
    base = plain.tokens / max(plain.seconds, 1e-9)
    hf = tallies.get(HF)
    hf_rate = hf.tokens / max(hf.seconds, 1e-9) if hf and hf.seconds else None
    rows: dict[str, Any] = {}
    for system in systems:
        t = tallies[system.name]
        rate = t.tokens / max(t.seconds, 1e-9)
        row: dict[str, Any] = {
            "tokens": t.tokens,
            "seconds": round(t.seconds, 4),
            "tok_s": round(rate, 2),
            "vs_specdec": round(rate / base, 4),
        }
        if hf_rate:
            row["vs_hf"] = round(rate / hf_rate, 4)
        if isinstance(system, EngineSystem) and system.drafter:
            row["drafter"], row["k"] = system.drafter, system.k
            row["acceptance_rate"] = round(t.accepted / max(1, t.drafted), 4)
            steps = t.verify_steps  # no verification: every target step made one token
            row["mean_accepted_length"] = round((t.accepted + steps) / steps if steps else 1.0, 4)
            row["acceptance_per_position"] = [
                round(a / max(1, d), 3)
                for d, a in zip(t.drafted_per_position, t.accepted_per_position)
            ]
        rows[system.name] = row
    ceiling_tokens, ceiling_steps, ref_tokens, ref_steps = lookup_figures
    return {
        "questions": questions,
        "systems": rows,
        "prompt_lookup_ceiling_tokens_per_step": round(ceiling_tokens / max(1, ceiling_steps), 3),
        "reference_3gram_tokens_per_step": round(ref_tokens / max(1, ref_steps), 3),
    }
