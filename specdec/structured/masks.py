"""The token masks a guide keeps: a bit per token (6 KB for SmolLM2's vocabulary, not 48), the
least recently used dropped past a bound, so memory stays bounded whatever the load."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch


class Masks:
    def __init__(self, size: int, kept: int):
        self.size, self.kept = size, kept  # tokens per mask, masks kept
        self.packed: OrderedDict[Hashable, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self.packed)

    def get(self, state: Hashable, make: Callable[[Any], np.ndarray]) -> torch.Tensor:
        """The [V] bool mask of a guide's ``state``: ``make(state)`` the first time."""
        packed = self.packed.get(state)
        if packed is None:
            packed = self.packed[state] = np.packbits(make(state))
            if len(self.packed) > self.kept:
                self.packed.popitem(last=False)
        self.packed.move_to_end(state)
        return torch.from_numpy(np.unpackbits(packed, count=self.size).view(bool))
