"""Draft providers: who proposes the tokens the target verifies."""

from specdec.drafters.base import DRAFTERS, Drafter, SpecConfig

__all__ = ["DRAFTERS", "Drafter", "SpecConfig"]
