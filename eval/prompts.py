"""Prompt sets shipped with specdec (``eval/prompts/*.jsonl``, written for this project)."""

from __future__ import annotations

import json
from pathlib import Path

PROMPT_DIR = Path(__file__).parent / "prompts"


def load_prompts(name: str) -> list[dict]:
    """Records of the set ``name``: each has ``prompt`` and ``max_tokens``."""
    path = PROMPT_DIR / f"{name}.jsonl"
    if not path.exists():
        known = sorted(p.stem for p in PROMPT_DIR.glob("*.jsonl"))
        raise ValueError(f"unknown prompt set {name!r}; known sets: {known}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
