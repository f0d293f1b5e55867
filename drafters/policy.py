"""Adaptive speculation: how many drafts each sequence verifies in the next step.

Two facts decide whether a draft is worth verifying:

* how likely it is to be accepted. Each sequence keeps an exponential moving average ``a`` of the
  pass rate of its accept tests (a step that accepts ``m`` of ``k`` drafts ran ``m`` passing
  tests and, if ``m < k``, one failing test; later drafts were never tested). The j-th draft of
  a step is accepted with probability about ``a**j`` (all before it must pass), so it adds
  ``a**j`` expected tokens;
* what it costs. A step's time ``t(N)`` grows with its number of query tokens ``N``: flat while
  reading the weights dominates, then linear once matmuls are compute-bound (a saturated batch).
  :class:`StepCostModel` measures ``t(N)`` on the real model at start-up. A draft model adds one
  of its own forwards per draft depth (``k`` drafts take ``k`` sequential draft forwards), timed
  the same way.

The policy hands out drafts one at a time, always to the sequence whose next draft is most
likely accepted, while the batch's expected tokens per second still rises: a draft is added only
if ``(E + a**j) / t(N + 1) > E / t(N)``. A lone stream with good acceptance gets the full ``k``;
as the batch fills, ``t`` steepens and drafts are withheld, so a saturated engine runs as it
would without speculation. Sequences whose drafts keep failing fall to ``k = 0`` and are probed
again now and then (their average decays back toward the prior).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from specdec.sequence import Sequence

PRIOR_ACCEPTANCE = 0.5  # acceptance assumed for a sequence not yet measured
EMA_WEIGHT = 0.3  # weight of the latest step in the moving average
RECOVERY = 0.02  # drift of an idle sequence's average back toward the prior, per step


class StepCostModel:
    """Piecewise-linear step time ``t(N)`` from timed forwards of N query tokens."""

    def __init__(self, points: list[tuple[int, float]]):
        self.sizes = [n for n, _ in points]
        self.times = [t for _, t in points]

    @staticmethod
    def measure(
        forward: Callable[[int], object], sizes: tuple[int, ...] = (1, 8, 32, 128), repeats: int = 3
    ) -> StepCostModel:
        """Time ``forward(n)`` (best of ``repeats``) at each size; enforce a monotone curve."""
        points, floor = [], 0.0
        for n in sizes:
            forward(n)  # warm up this shape
            best = min(_timed(forward, n) for _ in range(repeats))
            floor = max(floor, best)
            points.append((n, floor))
        return StepCostModel(points)

    def __call__(self, num_tokens: int) -> float:
        i = bisect.bisect_left(self.sizes, num_tokens)
        if i == 0:
            return self.times[0]
        j = min(i, len(self.sizes) - 1)  # extrapolate past the last point along the last segment
        n0, n1, t0, t1 = self.sizes[j - 1], self.sizes[j], self.times[j - 1], self.times[j]
        return t0 + (t1 - t0) * (num_tokens - n0) / (n1 - n0)


class AdaptivePolicy:
    """Chooses each sequence's number of drafts from its acceptance and the batch's step cost."""

    def __init__(
        self, max_drafts: int, cost: StepCostModel | None, draft_cost: StepCostModel | None = None
    ):
        self.max_drafts = max_drafts
        self.cost = cost  # None: fixed k (every eligible sequence gets max_drafts)
        self.draft_cost = draft_cost  # time of one drafter forward over N sequences, if any
        self.acceptance: dict[int, float] = {}  # seq_id -> moving average of acceptance
        self.seen: dict[int, tuple[int, int]] = {}  # seq_id -> (draft, accepted) counters used

    def num_drafts(self, seqs: list[Sequence], max_model_len: int) -> list[int]:
        """Drafts for each sequence next step (0 for one still prefilling or about to end)."""
        limits = [self._limit(seq, max_model_len) for seq in seqs]
        if self.cost is None:
            return limits
        rates = [self._observe(seq) for seq in seqs]
        ks = [0] * len(seqs)
        num_tokens, depth = len(seqs), 0
        expected = float(len(seqs))
        while True:
            gains = [
                rates[i] ** (ks[i] + 1) if ks[i] < limits[i] else -1.0 for i in range(len(seqs))
            ]
            best = max(range(len(seqs)), key=gains.__getitem__, default=None)
            if best is None or gains[best] <= 0:
                return ks
            new_depth = max(depth, ks[best] + 1)
            now = self._step_time(num_tokens, depth, len(seqs))
            then = self._step_time(num_tokens + 1, new_depth, len(seqs))
            if (expected + gains[best]) * now <= expected * then:
                return ks
            ks[best] += 1
            expected += gains[best]
            num_tokens, depth = num_tokens + 1, new_depth

    def _step_time(self, num_tokens: int, depth: int, batch: int) -> float:
        """Target forward over ``num_tokens`` plus ``depth`` sequential drafter forwards."""
        assert self.cost is not None
        drafting = depth * self.draft_cost(batch) if self.draft_cost is not None else 0.0
        return self.cost(num_tokens) + drafting

    def forget(self, seq: Sequence) -> None:
        self.acceptance.pop(seq.seq_id, None)
        self.seen.pop(seq.seq_id, None)

    def _limit(self, seq: Sequence, max_model_len: int) -> int:
        """Drafts that could still be used: none mid-prefill, none past max_tokens or context."""
        if seq.num_computed_tokens != seq.num_tokens - 1:
            return 0
        room = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
        cap = seq.params.num_speculative_tokens
        return max(0, min(self.max_drafts if cap is None else min(cap, self.max_drafts), room - 1))

    def _observe(self, seq: Sequence) -> float:
        """Fold the drafts verified since the last call into the sequence's average."""
        drafted, accepted = seq.metrics.num_draft_tokens, seq.metrics.num_accepted_tokens
        last_drafted, last_accepted = self.seen.get(seq.seq_id, (0, 0))
        rate = self.acceptance.get(seq.seq_id, PRIOR_ACCEPTANCE)
        if drafted > last_drafted:
            passed = accepted - last_accepted
            tests = passed + (1 if passed < drafted - last_drafted else 0)
            rate = (1 - EMA_WEIGHT) * rate + EMA_WEIGHT * passed / tests
        else:
            rate += RECOVERY * (PRIOR_ACCEPTANCE - rate)
        self.seen[seq.seq_id] = (drafted, accepted)
        self.acceptance[seq.seq_id] = rate
        return rate


def _timed(forward: Callable[[int], object], n: int) -> float:
    start = time.perf_counter()
    forward(n)
    return time.perf_counter() - start
