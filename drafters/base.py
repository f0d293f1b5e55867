"""The drafter interface and the speculative-decoding configuration.

A *drafter* proposes, after each step, up to ``k`` tokens that each running sequence is likely
to produce next; it writes them to ``seq.spec_token_ids``. The next step feeds them to the target
as extra query tokens and the verifier keeps drafts while they equal the target's own samples
(specdec/verifier.py), so the output never depends on what was drafted, only the speed does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

from specdec.models.quant import QUANTIZATIONS
from specdec.sequence import Sequence

DRAFTERS = ("prompt_lookup", "draft_model", "quantized_self")


@dataclass(slots=True)
class SpecConfig:
    """How to speculate: ``LLM(model, speculative=SpecConfig(...))`` (a dict works too)."""

    drafter: str = "prompt_lookup"  # one of DRAFTERS
    num_speculative_tokens: int = 8  # most drafts per sequence per step (k)
    prompt_lookup_min: int = 1  # shortest suffix n-gram prompt lookup matches
    prompt_lookup_max: int = 4  # longest suffix n-gram prompt lookup matches
    draft_model: str | os.PathLike | Any | None = None  # draft_model: a path or a model object
    draft_tokenizer: Any = None  # tokenizer of an in-memory draft model (checked vs the target)
    draft_quantization: str | None = None  # quantized_self: models/quant.py's; None: the fastest
    adaptive: bool = True  # choose k per sequence and step (see drafters/policy.py)

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.drafter!r}; choose one of {DRAFTERS}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be a positive integer, got "
                f"{self.num_speculative_tokens!r}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.draft_quantization is not None and self.draft_quantization not in QUANTIZATIONS:
            raise ValueError(
                f"draft_quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                f"{self.draft_quantization!r}"
            )
        if self.drafter == "draft_model" and self.draft_model is None:
            raise ValueError("drafter 'draft_model' needs draft_model= (a path or a model)")

    @staticmethod
    def coerce(value: SpecConfig | dict | None) -> SpecConfig | None:
        if value is None or isinstance(value, SpecConfig):
            return value
        if isinstance(value, dict):
            return SpecConfig(**value)
        raise TypeError(f"speculative must be a SpecConfig or a dict, got {type(value).__name__}")


class Drafter(Protocol):
    """Proposes draft tokens for the running sequences after each step."""

    name: str

    def draft_class(self, seq: Sequence) -> int:
        """What kind of draft ``seq`` would get now: 0 if none; the policy keeps acceptance
        averages per class (prompt lookup: the matched n-gram's length; a draft model: 1)."""

    def catch_up_tokens(self, seq: Sequence) -> int:
        """Tokens the drafter must feed through its own model before it can draft for ``seq``
        (0 for a drafter without one); the policy prices them (drafters/policy.py)."""

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> None:
        """Set ``seq.spec_token_ids`` to at most ``num_drafts[i]`` tokens for each sequence."""

    def forget(self, seq: Sequence) -> None:
        """Drop any state kept for a sequence that finished or was preempted."""
