"""Draft providers: who proposes the tokens the target verifies."""

from specdec.drafters.base import Drafter, DrafterBase, FinishedStep
from specdec.drafters.registry import DRAFTERS, SpecConfig

__all__ = ["DRAFTERS", "Drafter", "DrafterBase", "FinishedStep", "SpecConfig"]
