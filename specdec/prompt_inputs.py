"""What ``LLM`` takes as a prompt (text, token ids, or vLLM's prompt dictionaries), and the requests
it makes of prompts (:class:`Job`)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from specdec.config import SamplingParams, choice_seed
from specdec.lora import LoRARequest
from specdec.pooling import PoolingParams

# Raw text, token ids, or vLLM's prompt dictionaries: {"prompt": text} (TextPrompt) or
# {"prompt_token_ids": ids} (TokensPrompt)
Prompt = str | list[int] | dict[str, Any]
T = TypeVar("T")


def is_single(prompts: Any) -> bool:
    if isinstance(prompts, torch.Tensor | np.ndarray):
        return prompts.ndim == 1
    return isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int | np.integer)
    )


def dict_prompt(prompt: dict[str, Any]) -> str | list[int]:
    """The text or token ids of vLLM's ``TextPrompt`` / ``TokensPrompt`` dictionaries."""
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return str(prompt["prompt"])
    if keys == {"prompt_token_ids"}:
        return to_token_ids(prompt["prompt_token_ids"])
    raise TypeError(
        'a prompt dictionary takes one key, "prompt" (text) or "prompt_token_ids" (token ids); '
        f"got keys {', '.join(sorted(map(repr, keys)))}"
    )


def to_token_ids(prompt: Any) -> list[int]:
    """``prompt`` as a list of Python ints, from a sequence (or 1-D array) of integers."""
    if isinstance(prompt, torch.Tensor | np.ndarray):
        if prompt.ndim != 1:
            raise TypeError(f"token ids must be 1-D, got an array of shape {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
        raise TypeError(
            "a prompt is text, a list of token ids or a dict with 'prompt' or "
            f"'prompt_token_ids', not {type(prompt).__name__}"
        )
    ids = list(prompt)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise TypeError(f"token ids must be integers, got {type(t).__name__} ({t!r})")
    return [int(t) for t in ids]


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt, or several, as a list."""
    return [prompts] if is_single(prompts) else list(prompts)  # type: ignore[list-item, arg-type]


def priorities_for(priority: Sequence[int] | None, prompts: list[Prompt]) -> list[int]:
    """One priority per prompt (0 where none is given)."""
    priorities = [0] * len(prompts) if priority is None else list(priority)
    if len(priorities) != len(prompts):
        raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
    return priorities


def loras_for(lora_request: Any, n: int) -> list[LoRARequest | None]:  # noqa: ANN401
    """``n`` LoRA requests: none, one for every prompt, or one (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if len(lora_request) != n:
        raise ValueError(f"got {len(lora_request)} LoRA requests for {n} prompts")
    return list(lora_request)


def params_for(params: Any, kind: type[T], n: int) -> list[T]:  # noqa: ANN401
    """``n`` parameter objects of ``kind`` (``SamplingParams``, ``PoolingParams``): one given
    for every prompt, one per prompt, or the defaults where none is given."""
    if params is None or isinstance(params, kind):
        return [params or kind()] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} {kind.__name__} for {n} prompts")
    return list(params)


@dataclass(frozen=True, slots=True)
class Job:
    """One request for :meth:`LLM._run` to add: its prompt, how to sample it (or, for an
    embedding, to pool it), its priority, and its text where given as text."""

    token_ids: list[int]
    params: SamplingParams | PoolingParams
    priority: int = 0
    text: str | None = None
    lora: LoRARequest | None = None  # the LoRA adapter it runs through


def completion_params(params: SamplingParams, choice: int) -> SamplingParams:
    """The parameters of completion ``choice`` of ``params.n`` (see ``choice_seed``); a copy,
    so that validation does not rerun."""
    if params.n == 1:
        return params
    one = copy.copy(params)
    one.n, one.seed = 1, choice_seed(params.seed, choice)
    return one
