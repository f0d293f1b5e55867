"""Benchmark questions in the Spec-Bench format (Xia et al. 2024, ``question.jsonl``).

One JSON record per line: ``question_id`` (int or str), ``category`` (str) and ``turns`` (the
user's messages, in order: a multi-turn record is played turn by turn, each answer the model's
own). Any other field is ignored, except our optional ``max_tokens`` (the new tokens of each
turn). Spec-Bench's own file reads unchanged, categories we do not ship included.

``eval/data/specdec_bench.jsonl`` is ours, written for this project: 20 or more questions in
each of Spec-Bench's six categories (``mt_bench``: multi-turn conversation, ``translation``,
``summarization``, ``qa``, ``math_reasoning``, ``rag``: retrieval-augmented answers) and
``code_editing``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DATASET = Path(__file__).parent / "data" / "specdec_bench.jsonl"
CATEGORIES = (
    "mt_bench",
    "translation",
    "summarization",
    "qa",
    "math_reasoning",
    "rag",
    "code_editing",
)
"""The categories of the shipped dataset, in report order."""


@dataclass(frozen=True, slots=True)
class Question:
    """One benchmark record."""

    question_id: int | str
    category: str
    turns: tuple[str, ...]  # the user's messages
    max_tokens: int | None = None  # new tokens per turn; None: the benchmark's default

    def conversation(self, upto: int = 1) -> list[dict[str, str]]:
        """The first ``upto`` user turns with no answers between them (for one-shot users)."""
        return [{"role": "user", "content": t} for t in self.turns[:upto]]


def read_questions(path: str | os.PathLike = DEFAULT_DATASET) -> list[Question]:
    """The records of a Spec-Bench-format JSONL file, read through ``datasets`` (or line by
    line where it is not installed, as on a bare GPU image); a record that is not one raises
    ValueError naming the file and the record's number (from 1)."""
    if not Path(path).is_file():
        raise ValueError(f"no dataset at {path}: give a Spec-Bench-format JSONL file")
    try:
        rows = _json_lines(path)
    except Exception as exc:  # datasets wraps JSON errors in its own types
        raise ValueError(f"{path}: not JSON lines ({type(exc).__name__}: {exc})") from None
    questions = [_question(row, path, number) for number, row in enumerate(rows, start=1)]
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions


def _json_lines(path: str | os.PathLike) -> Any:
    try:
        from datasets import load_dataset
    except ImportError:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    return load_dataset("json", data_files=str(path), split="train")


def _question(row: dict[str, Any], path: str | os.PathLike, number: int) -> Question:
    where = f"{path}, record {number}"
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: 'turns' must be a non-empty list of strings, not {turns!r}")
    if not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError(f"{where}: every turn must be a non-empty string")
    category = row.get("category")
    if not isinstance(category, str) or not category:
        raise ValueError(f"{where}: 'category' must be a non-empty string, not {category!r}")
    question_id = row.get("question_id")
    if question_id is None:
        raise ValueError(f"{where}: 'question_id' is missing")
    max_tokens = row.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens <= 0):
        raise ValueError(f"{where}: 'max_tokens' must be a positive integer, not {max_tokens!r}")
    return Question(question_id, category, tuple(turns), max_tokens)


def by_category(
    questions: list[Question], per_category: int | None = None
) -> dict[str, list[Question]]:
    """The questions grouped by category (shipped categories first, in their order, then the
    others as they come), at most ``per_category`` of each (None: all)."""
    groups: dict[str, list[Question]] = {}
    for q in questions:
        groups.setdefault(q.category, []).append(q)
    order = [c for c in CATEGORIES if c in groups] + [c for c in groups if c not in CATEGORIES]
    return {c: groups[c][:per_category] for c in order}
