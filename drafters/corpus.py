"""The corpus heads are trained on (drafters/train_heads.py): the target's own answers.

Our engine answers the training prompts (a JSONL file read through ``datasets``; by default
``eval/prompts/train_heads.jsonl``, kept apart from every evaluation set) with continuous
batching until ``max_train_tokens``; the prompts left over join the corpus unanswered. The token
ids are saved in the run's directory and reused on resume.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.config import SamplingParams

if TYPE_CHECKING:
    from specdec.drafters.train_heads import TrainConfig

DEFAULT_DATA = Path(__file__).resolve().parent.parent / "eval" / "prompts" / "train_heads.jsonl"


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


def generate_corpus(llm: Any, cfg: TrainConfig) -> list[list[int]]:
    """Prompt + response token ids from the target itself, until ``max_train_tokens``."""
    conversations = read_prompts(cfg.data)
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
