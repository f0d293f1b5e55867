"""The corpus heads are trained on (drafters/train_heads.py): the target's own answers.

Our engine answers the training prompts (a JSONL file read through ``datasets``; by default
``eval/prompts/train_heads.jsonl``, kept apart from every evaluation set) with continuous
batching until ``max_train_tokens``; the prompts left over join the corpus unanswered. With
``self_prompts`` the target also writes prompts of its own first (:func:`self_written_prompts`,
Magpie's recipe). The token ids are saved in the run's directory and reused on resume.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.config import SamplingParams

if TYPE_CHECKING:
    from specdec.drafters.train_heads import TrainConfig

_EVAL = Path(__file__).resolve().parent.parent / "eval"
DEFAULT_DATA = _EVAL / "prompts" / "train_heads.jsonl"
EVALUATION_SETS = (_EVAL / "data" / "specdec_bench.jsonl", _EVAL / "prompts" / "runtime.jsonl")
"""The prompts every benchmark figure is measured on: no training prompt may quote them."""
RUN = 8  # words: a training prompt sharing a run this long with an evaluation set is dropped
_SENTINEL = "\x00user-turn\x00"


def read_prompts(path: str | os.PathLike) -> list[list[dict[str, str]]]:
    """The conversations of a JSONL prompt file, read through ``datasets``."""
    from datasets import load_dataset

    if not Path(path).is_file():
        raise ValueError(f"no training prompts at {path}")
    rows = load_dataset("json", data_files=str(path), split="train")
    conversations = []
    for row in rows:
        if row.get("messages"):
            conversations.append(row["messages"])
        elif row.get("prompt"):
            conversations.append([{"role": "user", "content": row["prompt"]}])
        else:
            raise ValueError(f"{path}: a record needs 'prompt' or 'messages'")
    return conversations


def word_runs(text: str, n: int = RUN) -> set[tuple[str, ...]]:
    """Every run of ``n`` consecutive words of ``text`` (lower-cased, punctuation dropped)."""
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def evaluation_runs() -> set[tuple[str, ...]]:
    """The word runs of every user message in the evaluation sets."""
    from specdec.eval.questions import read_questions

    bench, runtime = EVALUATION_SETS
    texts = [turn for question in read_questions(bench) for turn in question.turns]
    texts += [m["content"] for c in read_prompts(runtime) for m in c if m["role"] == "user"]
    return set().union(*map(word_runs, texts))


def self_written_prompts(llm: Any, n: int, seed: int = 0, batch: int = 64) -> list[str]:
    """``n`` distinct user messages written by the target itself.

    Magpie (Xu et al. 2024, "Alignment Data Synthesis from Scratch by Prompting Aligned LLMs
    with Nothing"): an instruction-tuned model given its chat template only up to the start of
    a user's turn writes a plausible user's message, sampled at temperature 1. Only messages
    the model ended itself (not cut by the length limit) are kept, each once, and none that
    shares an 8-word run with an evaluation set, so that benchmark figures stay on unseen text.
    """
    rendered = llm.render_chat([{"role": "user", "content": _SENTINEL}])
    if _SENTINEL not in rendered:
        raise ValueError("the chat template does not show a user's message: cannot self-prompt")
    opening = llm.encode(rendered[: rendered.index(_SENTINEL)])
    banned, seen, prompts = evaluation_runs(), set(), list[str]()
    tries = 0
    while len(prompts) < n:
        if tries >= 4 * n:
            raise ValueError(f"the target wrote {len(prompts)} usable prompts in {tries} tries")
        params = [
            SamplingParams(temperature=1.0, top_p=0.95, max_tokens=160, seed=seed * 10**9 + i)
            for i in range(tries, tries + batch)
        ]
        tries += batch
        for out in llm.generate([opening] * batch, params):
            text = out.text.strip()
            if out.finish_reason != "stop" or len(text) < 16 or text in seen:
                continue
            seen.add(text)
            if not word_runs(text) & banned:
                prompts.append(text)
        print(f"self-prompts: {len(prompts)} of {n} kept from {tries} written", flush=True)
    return prompts[:n]


def generate_corpus(llm: Any, cfg: TrainConfig) -> list[list[int]]:
    """Prompt + response token ids from the target itself, until ``max_train_tokens``."""
    conversations = read_prompts(cfg.data)
    if cfg.self_prompts:
        written = self_written_prompts(llm, cfg.self_prompts, cfg.seed)
        conversations += [[{"role": "user", "content": text}] for text in written]
        kept = Path(cfg.out) / "self_prompts.jsonl"  # to read, or to train on again (--data)
        kept.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in written), "utf-8")
    random.Random(cfg.seed).shuffle(conversations)
    corpus: list[list[int]] = []
    total, batch = 0, 64
    for start in range(0, len(conversations), batch):
        prompts = [llm.apply_chat_template(c) for c in conversations[start : start + batch]]
        params = [
            SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens, seed=i)
            for i in range(start, start + len(prompts))
        ]
        for out in llm.generate(prompts, params):
            corpus.append(out.prompt_token_ids + out.token_ids)
            total += len(corpus[-1])
        print(f"corpus: {len(corpus)} sequences, {total} tokens", flush=True)
        if total >= cfg.max_train_tokens:
            if cfg.unanswered:
                rest = conversations[start + batch :]
                corpus += [llm.apply_chat_template(c) for c in rest]
                print(f"corpus: {len(rest)} prompts more, unanswered", flush=True)
            break
    return corpus


def load_or_generate_corpus(llm: Any, cfg: TrainConfig, path: Path) -> list[list[int]]:
    """The corpus saved at ``path`` (a resumed run), else a new one, saved there."""
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    corpus = generate_corpus(llm, cfg)
    path.write_text(json.dumps(corpus), encoding="utf-8")
    return corpus
