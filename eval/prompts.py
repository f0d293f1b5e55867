"""Prompt sets shipped with specdec (``eval/prompts/*.jsonl``, written for this project): the
32-request runtime mix, the draft model's distillation prompts and the heads' training prompts.
The benchmark's questions are in ``eval/data`` (see :mod:`specdec.eval.questions`).

Each line of a set is one record: ``{"prompt": str, "max_tokens": int}``, a single user turn, or
``{"messages": [{"role": str, "content": str}, ...], "max_tokens": int}``, a conversation whose
last turn is the user's (``chat.jsonl``). ``max_tokens`` is the output length to generate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdec.chat_render import Conversation

PROMPT_DIR = Path(__file__).parent / "prompts"
ROLES = ("system", "user", "assistant")


def conversation(record: dict[str, Any]) -> Conversation:
    """The chat a record stands for: its ``messages``, or one user turn holding its ``prompt``."""
    if "messages" in record:
        return record["messages"]
    if "prompt" in record:
        return [{"role": "user", "content": record["prompt"]}]
    raise ValueError(f"a prompt record needs 'prompt' or 'messages'; it has {sorted(record)}")


def load_prompts(name: str) -> list[dict[str, Any]]:
    """The records of the set ``name``, each checked by :func:`check_record`."""
    path = PROMPT_DIR / f"{name}.jsonl"
    if not path.exists():
        known = sorted(p.stem for p in PROMPT_DIR.glob("*.jsonl"))
        raise ValueError(f"unknown prompt set {name!r}; known sets: {known}")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:  # json.JSONDecodeError is a ValueError too
            record = json.loads(line)
            check_record(record)
        except ValueError as exc:
            raise ValueError(f"{path}, line {number}: {exc}") from None
        records.append(record)
    return records


def check_record(record: Any) -> None:
    """Raise ValueError unless ``record`` is a record as the module docstring defines it."""
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, not {type(record).__name__}")
    max_tokens = record.get("max_tokens")
    if type(max_tokens) is not int or max_tokens <= 0:  # type(): True is an int, not a length
        raise ValueError(f"'max_tokens' must be a positive integer, not {max_tokens!r}")
    if "prompt" in record and "messages" in record:
        raise ValueError("a record has 'prompt' or 'messages', not both")
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise ValueError(f"'prompt' must be a non-empty string, not {record['prompt']!r}")
        return
    messages = conversation(record)  # raises for a record with neither
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"'messages' must be a non-empty list, not {messages!r}")
    for i, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and set(message) == {"role", "content"}
            and message["role"] in ROLES
            and isinstance(message["content"], str)
        ):
            raise ValueError(
                f"messages[{i}] must be {{'role': one of {ROLES}, 'content': str}}, not {message!r}"
            )
    if messages[-1]["role"] != "user":
        raise ValueError("the last of 'messages' must be the user's: the model answers it")
