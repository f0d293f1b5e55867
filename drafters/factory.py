"""Builds the drafter and the adaptive policy that a :class:`SpecConfig` asks for."""

from __future__ import annotations

from specdec.drafters.base import Drafter, SpecConfig
from specdec.drafters.policy import PRIOR_ACCEPTANCE, AdaptivePolicy, StepCostModel
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.engine import Engine
from specdec.loader import LoadedCheckpoint


def enable_speculation(engine: Engine, spec: SpecConfig, target: LoadedCheckpoint) -> None:
    """Attach a drafter and its policy to a fresh engine (before any request runs); ``target``
    is the checkpoint the engine's model was built from."""
    drafter: Drafter
    if spec.drafter == "prompt_lookup":
        drafter = PromptLookupDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        from specdec.drafters.draft_model import DraftModelDrafter

        if spec.drafter == "quantized_self":
            drafter = DraftModelDrafter.quantized_self(spec, engine, target)
        else:
            drafter = DraftModelDrafter.build(spec, engine, target.config)
    cost = draft_cost = None
    if spec.adaptive:
        cost = StepCostModel.measure(engine.runner.dummy_forward)
        draft_runner = getattr(drafter, "runner", None)
        if draft_runner is not None:  # a drafter with a model of its own: time it too
            draft_cost = StepCostModel.measure(draft_runner.dummy_forward, sizes=(1, 8, 32))
    engine.drafter = drafter
    prior = getattr(drafter, "prior_acceptance", PRIOR_ACCEPTANCE)
    engine.policy = AdaptivePolicy(spec.num_speculative_tokens, cost, draft_cost, prior)
