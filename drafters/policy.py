"""Adaptive speculation: how many drafts each sequence verifies in the next step.

Two facts decide whether a draft is worth verifying:

* how likely it is to be accepted. Each sequence keeps ``a``, the pass rate of its accept tests
  (a step that accepts ``m`` of ``k`` drafts ran ``m`` passing tests and, if ``m < k``, one
  failing test; later drafts were never tested), as the ratio of two exponential moving sums,
  passes over tests. The j-th draft of a step is accepted with probability about ``a**j`` (all
  before it must pass), so it adds ``a**j`` expected tokens. The ratio of sums is the geometric
  model's maximum-likelihood estimate; an average of each step's own ratio ``m / (m + 1)`` is
  biased low (for a true rate of 0.45 and 3 drafts a step it reads 0.29), and read that way an
  EAGLE head's acceptance kept the policy at one draft or none where four paid 1.5x;
* what it costs. Attention pads every sequence of a step to the longest query, so a step's
  time is a function ``t(P)`` of its *padded* query tokens ``P = B * (d + 1)`` (``B``
  sequences, ``d`` the most drafts any of them verifies): flat while reading the weights
  dominates, then steep once matmuls and attention are compute-bound (a full batch).
  :class:`StepCostModel` times forwards of the real model at start-up, then keeps learning from
  the engine's own decode and verification steps, so it prices the batches that actually run.
  A draft model adds one of its own forwards per draft depth (``d`` drafts take ``d`` sequential
  draft forwards), timed at start-up and then learnt from the engine's own proposals (as the
  target's steps are: a start-up forward sees a short context, while a draft model's forwards
  over 32 sequences of 400 tokens each spend most of their time in attention, and priced at
  the start-up figure they looked worth running where they cost more than they saved); the
  first also feeds the tokens its cache missed while it was not drafting (``catch_up_tokens``),
  priced at that many tokens.

The policy picks the depth ``d`` that maximises the expected tokens per second
``E(d) / t(B * (d + 1))``, where ``E(d)`` sums ``1 + a + a**2 + ...`` over each sequence's
drafts; each sequence then gets ``min(d, its limit)`` drafts, less any whose chance ``a**j``
is under ``MIN_CHANCE``. A lone stream with good acceptance gets the full ``k``; as the batch
fills, raising ``d`` costs ``B`` more padded tokens at once and ``t`` steepens, so drafts are
withheld and a saturated engine runs as it would without speculation. Sequences whose drafts
keep failing fall to ``k = 0`` and are probed again now and then: an average not tested in a
step drifts back, a sequence's toward its class's and, ten times slower (a probe of a draft
model costs its forwards), a class's toward the prior.

Averages are kept per *draft class*, a number the drafter gives each sequence before it drafts
(``Drafter.draft_class``): prompt lookup reports the length of the n-gram it matched, because a
4-gram match is accepted far more often than a 1-gram one, and 0 when it has nothing to offer,
so no draft budget goes to a sequence without a match. A draft model has a single class.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import statistics
import time
from collections.abc import Callable

from specdec.sequence import Sequence

PRIOR_ACCEPTANCE = 0.5  # acceptance assumed for a sequence not yet measured (by default)
EMA_WEIGHT = 0.3  # weight of the latest step in a sequence's moving sums
CLASS_EMA_WEIGHT = 0.05  # weight of one sequence's step in its class's moving sums
MIN_CHANCE = 0.05  # a draft less likely than this to be accepted is not verified
RECOVERY = 0.02  # per-step drift of an untested sequence's average toward its class's
CLASS_RECOVERY = 0.002  # per-step drift of an untested class's average toward the prior


class StepCostModel:
    """Step time ``t(N)``, piecewise linear in ``N``, the step's padded query tokens.

    It starts from timed forwards (:meth:`measure`) and then learns from the real steps the
    engine reports (:meth:`observe`): a start-up forward of one made-up prompt misses costs a
    real batch has (gathering each sequence's keys, padding mixed query lengths, verification),
    and the policy must compare the steps it will actually run. Knots sit at the measured sizes,
    at every size up to 16 (the curve is not smooth there: float32 steps on MKL cost about the
    same from 1 to 3 rows and jump at 4) and at powers of two. An observation moves the two
    knots around its ``N`` toward the time seen, in proportion to how close each is (a least
    mean squares step); read back, the curve is made non-decreasing.

    What steps of ``N`` tokens teach is the median of the latest five times seen at that ``N``,
    once there are three: a step the host stalled must not move the curve (on the 2-core VM we
    develop on, a step now and then takes 1.5-2x as long, sometimes two in a row). Taken as they
    came, such steps priced a 1-draft verification 10-30% above a decode when it costs 1-2%
    more; the policy then stopped verifying 1 draft, so no later step of that size could correct
    the knot, and a third of the steps that should have drafted went without. A real change in
    step time passes from its third step on.

    Stalls longer than that still happen (an EAGLE run once learnt that 2 query tokens cost 24 ms
    where 5 cost 16). So that no knot stays wrong for good, a knot no observation has moved in
    the latest ``STALE`` drifts back toward its start-up value (``RECOVERY`` per observation),
    as an untested acceptance drifts back to its prior: a size the policy shuns is tried again
    before long, and what it costs then is learnt anew.
    """

    LEARNING_RATE = 0.2  # share of a step's prediction error taken into the curve
    STALE = 50  # observations after which a knot none of them moved starts to drift back
    RECOVERY = 0.01  # per observation, drift of a stale knot toward its start-up value
    WINDOW = 5  # latest times kept per step size; their median is what the curve learns
    MAX_KNOT = 4096

    def __init__(self, points: list[tuple[int, float]]):
        measured = sorted(points)
        sizes = {n for n, _ in measured} | set(range(1, 17))  # MKL's fp32 GEMM jumps at 4 rows
        sizes |= {2**i for i in range(self.MAX_KNOT.bit_length())}
        self.sizes = sorted(sizes)
        sizes_measured, times_measured = [n for n, _ in measured], [t for _, t in measured]
        self.values = [_interpolate(sizes_measured, times_measured, n) for n in self.sizes]
        self.start = list(self.values)  # the start-up curve, where stale knots drift back
        self.moved = [0] * len(self.sizes)  # the observation that last moved each knot
        self.times = self._monotone()
        self.num_observed = 0
        self.recent: dict[int, collections.deque[float]] = {}  # N -> latest times seen at N

    @staticmethod
    def measure(
        forward: Callable[[int], object],
        sizes: tuple[int, ...] = (1, 2, 3, 4, 8, 16, 32, 128),
        repeats: int = 3,
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
        return _interpolate(self.sizes, self.times, num_tokens)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Learn from a real step of ``num_tokens`` query tokens that took ``seconds``."""
        recent = self.recent.setdefault(num_tokens, collections.deque(maxlen=self.WINDOW))
        recent.append(seconds)
        self.num_observed += 1
        if len(recent) <= self.WINDOW // 2:
            return  # too few to tell a stall from a real change
        seconds = statistics.median(recent)
        i = min(bisect.bisect_left(self.sizes, num_tokens), len(self.sizes) - 1)
        if i == 0 or self.sizes[i] == num_tokens:
            moved = {i}
            self.values[i] += self.LEARNING_RATE * (seconds - self.values[i])
        else:
            moved = {i - 1, i}
            n0, n1 = self.sizes[i - 1], self.sizes[i]
            w = (num_tokens - n0) / (n1 - n0)
            error = seconds - ((1 - w) * self.values[i - 1] + w * self.values[i])
            self.values[i - 1] += self.LEARNING_RATE * (1 - w) * error
            self.values[i] += self.LEARNING_RATE * w * error
        for j, start in enumerate(self.start):
            if j in moved:
                self.moved[j] = self.num_observed
            elif self.num_observed - self.moved[j] > self.STALE:
                self.values[j] += self.RECOVERY * (start - self.values[j])
        self.times = self._monotone()

    def _monotone(self) -> list[float]:
        return list(itertools.accumulate(self.values, max))


def _interpolate(sizes: list[int], times: list[float], n: int) -> float:
    """Piecewise-linear ``t(n)`` through sorted ``(sizes, times)``, extended along the ends."""
    i = bisect.bisect_left(sizes, n)
    if i == 0 or len(sizes) == 1:
        return times[0] if i == 0 else times[-1]
    j = min(i, len(sizes) - 1)  # extrapolate past the last point along the last segment
    n0, n1, t0, t1 = sizes[j - 1], sizes[j], times[j - 1], times[j]
    return t0 + (t1 - t0) * (n - n0) / (n1 - n0)


class AdaptivePolicy:
    """Chooses each sequence's number of drafts from its acceptance and the batch's step cost."""

    def __init__(
        self,
        max_drafts: int,
        cost: StepCostModel | None,
        draft_cost: StepCostModel | None = None,
        prior_acceptance: float = PRIOR_ACCEPTANCE,
        drafts_in_one_pass: bool = False,
        class_priors: dict[int, float] | None = None,
    ):
        self.max_drafts = max_drafts
        self.prior_acceptance = prior_acceptance  # the drafter's acceptance before any is measured
        self.class_priors = class_priors or {}  # classes whose prior is their own
        self.cost = cost  # None: fixed k (every eligible sequence gets max_drafts)
        self.draft_cost = draft_cost  # time of one drafter forward over N sequences, if any
        self.drafts_in_one_pass = drafts_in_one_pass  # one forward drafts every depth (Medusa)
        self.acceptance: dict[int, dict[int, float]] = {}  # seq_id -> class -> pass rate
        self.class_acceptance: dict[int, float] = {}  # class -> pass rate over sequences
        # the moving sums of tests behind those rates (absent: 1, the prior's weight)
        self.test_sums: dict[int, dict[int, float]] = {}  # seq_id -> class -> tests
        self.class_test_sums: dict[int, float] = {}  # class -> tests
        self.tested: dict[int, int] = {}  # seq_id -> class it verified drafts of, last step
        self.last_class: dict[int, int] = {}  # seq_id -> class of its latest drafts
        self.pending = 0  # catch-up tokens of the latest allocation's drafting sequences
        self.modelled: list[bool] = []  # latest allocation: whether each sequence's drafts run
        # the drafter's model (a class drafted without it, as by prompt lookup, costs nothing)

    def num_drafts(
        self,
        seqs: list[Sequence],
        max_model_len: int,
        classify: Callable[[Sequence], int] | None = None,
        backlog: Callable[[Sequence], int] | None = None,
        runs_model: Callable[[int], bool] | None = None,
    ) -> list[int]:
        """Drafts for each sequence next step (0 for one still prefilling or about to end).

        ``classify`` is the drafter's ``draft_class`` (0: no draft to offer); None: one class.
        ``backlog`` is the drafter's ``catch_up_tokens``: what a draft model's first forward
        must feed before it drafts (a sequence it has not drafted for in a while has many),
        priced with the draft cost curve at that many tokens. ``runs_model`` is the drafter's
        ``runs_model``: whether drafts of a class come from its model (and cost its forwards);
        None: all of them do.
        """
        limits = [self._limit(seq, max_model_len) for seq in seqs]
        classes = [classify(s) if classify and k else 1 for s, k in zip(seqs, limits)]
        limits = [k if c else 0 for k, c in zip(limits, classes)]
        modelled = [runs_model(c) if runs_model else True for c in classes]
        self.modelled = modelled
        if self.cost is None:
            ks = limits
        else:
            tested, self.tested = self.tested, {}
            for c in self.class_acceptance.keys() - set(tested.values()):
                drift = CLASS_RECOVERY * (self.prior(c) - self.class_acceptance[c])
                self.class_acceptance[c] += drift
            rates = [self._rate(s, c, tested.get(s.seq_id) == c) for s, c in zip(seqs, classes)]
            backlogs = [
                backlog(s) if backlog and k and m else 0 for s, k, m in zip(seqs, limits, modelled)
            ]
            ks = self._allocate(rates, limits, sum(backlogs), modelled)
            self.pending = sum(b for b, k in zip(backlogs, ks) if k)
        for seq, k, c in zip(seqs, ks, classes):
            if k:
                self.last_class[seq.seq_id] = c
        return ks

    def _allocate(
        self,
        rates: list[float],
        limits: list[int],
        pending: int = 0,
        modelled: list[bool] | None = None,
    ) -> list[int]:
        """The draft depth ``d`` that maximises expected tokens per second; each sequence then
        verifies ``min(d, its limit)`` drafts. ``modelled[i]``: sequence i's drafts run the
        drafter's model (default: all do)."""
        # Drafts worth verifying at all: the j-th only while its chance a**j >= MIN_CHANCE.
        useful = [
            next((j for j in range(k) if a ** (j + 1) < MIN_CHANCE), k)
            for a, k in zip(rates, limits)
        ]
        modelled = modelled or [True] * len(rates)
        model_batch = sum(modelled)  # as the drafter's forwards are priced: every such sequence
        model_useful = max((k for k, m in zip(useful, modelled) if m), default=0)
        best_depth, best_rate = 0, 0.0
        for depth in range(max(useful, default=0) + 1):
            expected = sum(
                1 + sum(a**j for j in range(1, min(depth, k) + 1)) for a, k in zip(rates, useful)
            )
            model_depth = min(depth, model_useful)
            step = self._step_time(depth, len(rates), pending, model_batch, model_depth)
            rate = expected / step
            if rate > best_rate * (1 + 1e-9):
                best_depth, best_rate = depth, rate
        return [min(best_depth, k) for k in useful]

    def observe_step(self, padded_tokens: int, seconds: float) -> None:
        """Learn the step cost from a real decode/verify step (forward plus verification)."""
        if self.cost is not None:
            self.cost.observe(padded_tokens, seconds)

    def observe_drafting(self, num_drafts: list[int], seconds: float) -> None:
        """Learn the draft cost from a real proposal: the drafter gave ``num_drafts`` drafts to
        the sequences of the latest allocation in ``seconds`` (forwards, catch-up, sampling)."""
        if len(self.modelled) == len(num_drafts):  # only the model's drafts cost its forwards
            num_drafts = [k for k, m in zip(num_drafts, self.modelled) if m]
        batch, depth = sum(1 for k in num_drafts if k), max(num_drafts, default=0)
        if self.draft_cost is None or not depth:
            return
        forwards = 1 if self.drafts_in_one_pass else depth
        catch_up = self.draft_cost(max(batch, self.pending)) - self.draft_cost(batch)
        self.draft_cost.observe(batch, max(seconds - catch_up, 0.0) / forwards)

    def _step_time(
        self,
        depth: int,
        batch: int,
        pending: int = 0,
        model_batch: int | None = None,
        model_depth: int | None = None,
    ) -> float:
        """A target forward of ``batch`` sequences padded to ``depth`` drafts each, plus
        ``model_depth`` (default ``depth``) sequential drafter forwards over the ``model_batch``
        (default ``batch``) sequences whose drafts come from the model, the first of them feeding
        the ``pending`` catch-up tokens."""
        assert self.cost is not None
        model_batch = batch if model_batch is None else model_batch
        model_depth = depth if model_depth is None else model_depth
        drafting = 0.0
        if self.draft_cost is not None and model_depth and model_batch:
            drafting = self.draft_cost(max(model_batch, pending))
            if not self.drafts_in_one_pass:
                drafting += (model_depth - 1) * self.draft_cost(model_batch)
        return self.cost(batch * (depth + 1)) + drafting

    def forget(self, seq: Sequence) -> None:
        for table in (self.acceptance, self.test_sums, self.tested, self.last_class):
            table.pop(seq.seq_id, None)

    def _limit(self, seq: Sequence, max_model_len: int) -> int:
        """Drafts that could still be used: none mid-prefill, none past max_tokens or context."""
        if seq.num_computed_tokens != seq.num_tokens - 1:
            return 0
        room = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
        cap = seq.params.num_speculative_tokens
        return max(0, min(self.max_drafts if cap is None else min(cap, self.max_drafts), room - 1))

    def observe_verification(
        self, seqs: list[Sequence], num_drafts: list[int], num_accepted: list[int]
    ) -> None:
        """Fold a step's verification (``seqs[i]`` accepted ``num_accepted[i]`` of its
        ``num_drafts[i]`` drafts, as the verifier counted) into the averages of the class each
        sequence drafted in."""
        for seq, drafted, passed in zip(seqs, num_drafts, num_accepted):
            if not drafted:
                continue
            tested = self.last_class.get(seq.seq_id, 1)
            self.tested[seq.seq_id] = tested
            tests = passed + (1 if passed < drafted else 0)
            shared = self.class_acceptance.get(tested, self.prior(tested))
            own, weights = (t.setdefault(seq.seq_id, {}) for t in (self.acceptance, self.test_sums))
            own[tested], weights[tested] = _fold(
                own.get(tested, shared), weights.get(tested, 1.0), passed, tests, EMA_WEIGHT
            )
            self.class_acceptance[tested], self.class_test_sums[tested] = _fold(
                shared, self.class_test_sums.get(tested, 1.0), passed, tests, CLASS_EMA_WEIGHT
            )

    def prior(self, draft_class: int) -> float:
        """The acceptance assumed for ``draft_class`` before any is measured."""
        return self.class_priors.get(draft_class, self.prior_acceptance)

    def value(self, seq: Sequence, draft_class: int, modelled: bool) -> float:
        """Expected tokens per second of ``seq`` stepping alone with drafts of ``draft_class``
        at the best depth, from its acceptance estimate (read, not drifted) and the cost curves;
        ``modelled``: the drafts cost the drafter's forwards. Lets a drafter with two sources
        pick the better one for a sequence (drafters/lookup_first.py)."""
        own = self.acceptance.get(seq.seq_id, {})
        a = own.get(draft_class, self.class_acceptance.get(draft_class, self.prior(draft_class)))
        if self.cost is None:  # fixed k: no costs to weigh, only the acceptance
            return a
        best, expected = 0.0, 0.0
        for depth in range(self.max_drafts + 1):
            expected += a**depth
            drafting = 0.0
            if modelled and depth and self.draft_cost is not None:
                drafting = self.draft_cost(1) * (1 if self.drafts_in_one_pass else depth)
            best = max(best, expected / (self.cost(depth + 1) + drafting))
        return best

    def _rate(self, seq: Sequence, draft_class: int, just_tested: bool) -> float:
        """The sequence's acceptance average for ``draft_class`` (its class's, if it has none);
        one not tested this step drifts back toward the class average, to be probed again."""
        shared = self.class_acceptance.get(draft_class, self.prior(draft_class))
        own = self.acceptance.get(seq.seq_id, {})
        if draft_class not in own:
            return shared
        if not just_tested:
            own[draft_class] += RECOVERY * (shared - own[draft_class])
        return own[draft_class]


def _fold(
    rate: float, tests: float, passed: int, tested: int, weight: float
) -> tuple[float, float]:
    """A pass rate kept as moving sums (``rate * tests`` passes in ``tests`` tests) after a step
    of ``tested`` tests, ``passed`` of which passed, given ``weight``: the new rate and tests."""
    new_tests = (1 - weight) * tests + weight * tested
    return ((1 - weight) * rate * tests + weight * passed) / new_tests, new_tests


def _timed(forward: Callable[[int], object], n: int) -> float:
    start = time.perf_counter()
    forward(n)
    return time.perf_counter() - start
