"""The drafter interface.

A *drafter* proposes, after each step, up to ``k`` tokens that each running sequence is likely
to produce next; it writes them to ``seq.spec_token_ids``. The next step feeds them to the target
as extra query tokens and the verifier keeps drafts while they equal the target's own samples
(specdec/verifier.py), so the output never depends on what was drafted, only the speed does.

A drafter is registered once, by its class (drafters/registry.py): the class names itself
(``name``), declares its options (``Options``, a dataclass) and builds itself for an engine
(``build``). The engine builds it with the engine and owns it; each step it hands the drafter
the step just run (:class:`FinishedStep`), whose result carries hidden states when the drafter
asks for them (``needs_token_hidden_states``) and whose verification says what was accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from specdec.sequence import Sequence

if TYPE_CHECKING:
    from specdec.engine import Engine
    from specdec.loader import LoadedCheckpoint
    from specdec.runner import StepResult
    from specdec.scheduler import SchedulerOutput
    from specdec.verifier import Verification


@dataclass(slots=True)
class FinishedStep:
    """One engine step, as a drafter reads it after verification."""

    scheduled: SchedulerOutput  # the sequences that ran and their query tokens, batch order
    result: StepResult  # the forward's logits and hidden states
    verification: Verification  # what each scheduled sequence emitted and accepted


class Drafter(Protocol):
    """Proposes draft tokens for the running sequences after each step."""

    name: str
    prior_acceptance: float  # the policy's acceptance estimate before it has measured any
    needs_token_hidden_states: bool  # the step's final hidden state at every query token
    max_drafts: int | None  # most drafts it can propose per sequence (None: no limit)
    drafts_in_one_pass: bool  # one draft_forward yields every depth (else one per depth)
    # One of the drafter's own forwards over n sequences, which the policy times at start-up
    # to price drafting (drafters/policy.py); None for a drafter without a model of its own.
    draft_forward: Callable[[int], object] | None

    def draft_class(self, seq: Sequence) -> int:
        """What kind of draft ``seq`` would get now: 0 if none; the policy keeps acceptance
        averages per class (prompt lookup: the matched n-gram's length; a draft model: 1)."""

    def catch_up_tokens(self, seq: Sequence) -> int:
        """Tokens the drafter must feed through its own model before it can draft for ``seq``
        (0 for a drafter without one); the policy prices them (drafters/policy.py)."""

    # Optional: ``runs_model(draft_class) -> bool``, whether drafts of that class come from the
    # drafter's model and cost its forwards (drafters/lookup_first.py: lookup's classes do not).
    # Without it, every class of a drafter with a ``draft_forward`` does.
    # Optional: ``copy_blocks(copies)``, for a drafter that keeps K/V of its own by the engine's
    # block ids and reads it at positions the target computed (EAGLE's head): copy those
    # blocks, (source, destination) pairs, as the target's runner does for a cached partial
    # block (specdec/block_manager.py), before the step's sources are let go.

    def propose(self, seqs: list[Sequence], num_drafts: list[int], step: FinishedStep) -> None:
        """Set ``seq.spec_token_ids`` to at most ``num_drafts[i]`` tokens for each running
        sequence; ``step`` is the step just run (the running sequences include every scheduled
        one that did not finish, and possibly some that were not scheduled)."""

    def forget(self, seq: Sequence) -> None:
        """Drop any state kept for a sequence that finished or was preempted."""


@dataclass(slots=True)
class NoOptions:
    """The options of a drafter that has none."""


class DrafterBase:
    """Defaults for a drafter without a model of its own and without options: it reads no
    hidden states, drafts for every sequence as one class, and keeps no state per sequence."""

    name: ClassVar[str] = ""
    prior_acceptance: float = 0.5
    needs_token_hidden_states: bool = False
    max_drafts: int | None = None
    drafts_in_one_pass: bool = False
    draft_forward: Callable[[int], object] | None = None
    # a model of the target's shapes that drafts through each request's LoRA adapter too (the
    # engine installs every adapter in it: quantized_self); None: drafts from the base model
    adapter_model: Any = None

    Options: ClassVar[type[Any]] = NoOptions

    @classmethod
    def build(cls, options: Any, engine: Engine, target: LoadedCheckpoint) -> DrafterBase:
        return cls()

    def draft_class(self, seq: Sequence) -> int:
        return 1

    def catch_up_tokens(self, seq: Sequence) -> int:
        return 0

    def forget(self, seq: Sequence) -> None:
        pass
