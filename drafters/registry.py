"""Every drafter, registered once by its class, and the configuration that picks one.

A drafter class names itself (``name``), declares its options (``Options``, a dataclass whose
fields are the keyword arguments :class:`SpecConfig` takes for it) and builds itself for an
engine (``build``). Adding a drafter is writing that class and listing it in ``DRAFTERS``; the
CLI's ``--drafter`` choices, the option checks and the factory all read this one table.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdec.drafters.base import Drafter
from specdec.drafters.draft_model import DraftModelDrafter, QuantizedSelfDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.lookup_first import MAX_NGRAM, LookupFirst
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.policy import AdaptivePolicy, StepCostModel
from specdec.drafters.prompt_lookup import PromptLookupDrafter

if TYPE_CHECKING:
    from specdec.engine import Engine
    from specdec.loader import LoadedCheckpoint

DRAFTERS: dict[str, Any] = {
    cls.name: cls
    for cls in (
        PromptLookupDrafter,
        DraftModelDrafter,
        QuantizedSelfDrafter,
        MedusaDrafter,
        EagleDrafter,
    )
}


@dataclass(slots=True, init=False)
class SpecConfig:
    """How to speculate: ``LLM(model, speculative=SpecConfig("prompt_lookup", 8))``.

    Keyword arguments past the three below are the drafter's options (the fields of its
    ``Options``), e.g. ``SpecConfig("draft_model", draft_model="path/to/draft")``. A flat dict
    works too: ``speculative={"drafter": "prompt_lookup", "prompt_lookup_max": 3}``.
    """

    drafter: str | Drafter  # a name in DRAFTERS, or a drafter object of your own
    num_speculative_tokens: int  # most drafts per sequence per step (k)
    adaptive: bool  # choose k per sequence and step (see drafters/policy.py)
    # a model drafter drafts by prompt lookup instead where the last lookup_first or more
    # tokens occurred earlier (drafters/lookup_first.py); None: never
    lookup_first: int | None
    options: Any  # the drafter's Options (None for a drafter object)

    def __init__(
        self,
        drafter: str | Drafter = "prompt_lookup",
        num_speculative_tokens: int = 8,
        adaptive: bool = True,
        lookup_first: int | None = None,
        **options: Any,
    ):
        self.drafter, self.adaptive = drafter, adaptive
        self.num_speculative_tokens = num_speculative_tokens
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be a positive integer, got {num_speculative_tokens!r}"
            )
        self.lookup_first = lookup_first
        if lookup_first is not None:
            if not isinstance(lookup_first, int) or not 1 <= lookup_first <= MAX_NGRAM:
                raise ValueError(
                    f"lookup_first must be an n-gram length from 1 to {MAX_NGRAM}, got "
                    f"{lookup_first!r}"
                )
            if isinstance(drafter, str) and drafter == PromptLookupDrafter.name:
                raise ValueError(
                    "lookup_first is for drafters with a model (quantized_self, draft_model, "
                    "eagle, medusa); prompt_lookup already looks up every draft"
                )
        if not isinstance(drafter, str):
            if options:
                raise ValueError("a drafter object takes no options: configure the object")
            self.options = None
            return
        if drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {drafter!r}; choose one of {tuple(DRAFTERS)}")
        option_class = DRAFTERS[drafter].Options
        known = [f.name for f in dataclasses.fields(option_class)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(
                f"drafter {drafter!r} has no option {unknown[0]!r}; its options: "
                f"{', '.join(known) or 'none'}"
            )
        self.options = option_class(**options)

    @classmethod
    def from_vllm(cls, config: dict[str, Any]) -> SpecConfig:
        """The configuration vLLM's ``LLM(speculative_config={...})`` describes: ``method``
        ("ngram", "eagle", "medusa" or "draft_model"; without one, a ``model`` makes a draft
        model), ``model`` (the draft model, or the heads directory), ``num_speculative_tokens``
        and ngram's ``prompt_lookup_min`` / ``prompt_lookup_max``. The depth stays adaptive, up
        to ``num_speculative_tokens`` (vLLM drafts that many every step; the output is the same).
        """
        known = (
            "method",
            "model",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
        )
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(
                f"speculative_config key {unknown[0]!r} is not supported here; supported: "
                f"{', '.join(known)}"
            )
        method = config.get("method") or ("draft_model" if config.get("model") else None)
        drafters = {
            "ngram": "prompt_lookup",
            "eagle": "eagle",
            "medusa": "medusa",
            "draft_model": "draft_model",
        }
        if method not in drafters:
            raise ValueError(
                f"speculative_config method {method!r} is not supported here; choose one of "
                f"{', '.join(drafters)} (eagle and medusa take heads from specdec train-heads)"
            )
        options: dict[str, Any] = {}
        model = config.get("model")
        if method == "ngram":
            options = {
                k: config[k] for k in ("prompt_lookup_min", "prompt_lookup_max") if k in config
            }
            if model not in (None, "ngram", "[ngram]"):
                raise ValueError(f"method 'ngram' takes no draft model, got {model!r}")
        elif "prompt_lookup_min" in config or "prompt_lookup_max" in config:
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max are ngram's, not {method}'s")
        elif model is not None:
            options = {"draft_model" if method == "draft_model" else "heads": model}
        if "num_speculative_tokens" in config:
            options["num_speculative_tokens"] = config["num_speculative_tokens"]
        return cls(drafters[method], **options)

    @staticmethod
    def coerce(value: SpecConfig | dict | None) -> SpecConfig | None:
        if value is None or isinstance(value, SpecConfig):
            return value
        if isinstance(value, dict):
            return SpecConfig(**value)
        raise TypeError(f"speculative must be a SpecConfig or a dict, got {type(value).__name__}")


def build_speculation(
    spec: SpecConfig, engine: Engine, target: LoadedCheckpoint | None
) -> tuple[Drafter, AdaptivePolicy]:
    """The drafter ``spec`` names, built for ``engine`` (whose model came from ``target``),
    and the policy choosing its depth, with step costs timed on the engine's own model."""
    if isinstance(spec.drafter, str):
        check_drafter_device(spec.drafter, engine.device)
        drafter = DRAFTERS[spec.drafter].build(spec.options, engine, target)
    else:
        drafter = spec.drafter
    if spec.lookup_first is not None:
        drafter = LookupFirst(drafter, spec.lookup_first)
    cost = draft_cost = None
    if spec.adaptive:
        cost = StepCostModel.measure(engine.runner.dummy_forward)
        if drafter.draft_forward is not None:  # a drafter with a model of its own: time it too
            draft_cost = StepCostModel.measure(drafter.draft_forward, sizes=(1, 8, 32))
    policy = AdaptivePolicy(
        spec.num_speculative_tokens,
        cost,
        draft_cost,
        drafter.prior_acceptance,
        drafts_in_one_pass=drafter.drafts_in_one_pass,  # Medusa: one forward for every depth
        class_priors=getattr(drafter, "class_priors", None),
    )
    if isinstance(drafter, LookupFirst):
        drafter.policy = policy  # its estimates choose between lookup and the model
    return drafter, policy


CHECKED_ON_CUDA = ("prompt_lookup",)
"""Drafters run on a GPU and found exact there (``make gpu-check``)."""
UNCHECKED_CUDA_ENV = "SPECDEC_UNCHECKED_CUDA_DRAFTERS"
"""Set to 1, lets the drafters written for CUDA but not yet run on a GPU (``draft_model``,
``eagle``, ``medusa``) run there: for ``make gpu-check``, which checks them."""


def check_drafter_device(drafter: str, device: Any) -> None:
    if device.type == "cpu" or drafter in CHECKED_ON_CUDA:
        return
    if drafter == "quantized_self":
        raise ValueError(
            f"drafter 'quantized_self' runs on the CPU only (its quantized weights need the CPU "
            f"kernels); on {device} use 'prompt_lookup' or device='cpu'"
        )
    if os.environ.get(UNCHECKED_CUDA_ENV) != "1":
        raise ValueError(
            f"drafter {drafter!r} has not yet been checked on a GPU; on {device} use "
            f"'prompt_lookup' or device='cpu' ({UNCHECKED_CUDA_ENV}=1 runs it anyway)"
        )
