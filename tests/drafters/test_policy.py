import pytest

from specdec.config import SamplingParams
from specdec.drafters.policy import AdaptivePolicy, StepCostModel
from specdec.sequence import Sequence


def decoding_seq(seq_id: int, max_tokens: int = 100):
    seq = Sequence(seq_id, list(range(20)), 10, SamplingParams(max_tokens=max_tokens))
    seq.num_computed_tokens = seq.num_tokens - 1  # fully prefilled, decoding
    return seq


def verified(policy: AdaptivePolicy, seqs: list[Sequence], drafted: int, accepted: list[int]):
    """Tell ``policy`` that each of ``seqs`` verified ``drafted`` drafts and accepted so many."""
    policy.observe_verification(seqs, [drafted] * len(seqs), accepted)


FLAT = StepCostModel([(1, 1.0), (64, 1.05), (128, 1.1)])  # weight-bound: drafts nearly free
STEEP = StepCostModel([(1, 1.0), (2, 2.0), (128, 128.0)])  # compute-bound: every token costs


def test_cost_model_interpolates_and_extrapolates():
    cost = StepCostModel([(1, 1.0), (9, 2.0)])
    assert cost(1) == 1.0 and cost(5) == 1.5 and cost(17) == 3.0 and cost(0) == 1.0


def test_cheap_steps_and_good_acceptance_get_the_full_k():
    policy = AdaptivePolicy(max_drafts=8, cost=FLAT)
    seqs = [decoding_seq(0), decoding_seq(1)]
    for step in range(5):  # every draft accepted, step after step
        if step:
            verified(policy, seqs, 8, [8, 8])
        ks = policy.num_drafts(seqs, 1000)
    assert ks == [8, 8]


def test_compute_bound_steps_get_no_drafts():
    policy = AdaptivePolicy(max_drafts=8, cost=STEEP)
    assert policy.num_drafts([decoding_seq(i) for i in range(4)], 1000) == [0, 0, 0, 0]


def test_failing_drafts_shrink_k_and_passing_ones_keep_it():
    policy = AdaptivePolicy(max_drafts=8, cost=StepCostModel([(1, 1.0), (128, 3.0)]))
    good, bad = decoding_seq(0), decoding_seq(1)
    for _ in range(1, 6):
        verified(policy, [good, bad], 8, [8, 0])
        ks = policy.num_drafts([good, bad], 1000)
    assert ks[0] > ks[1] and ks[1] <= 1


def test_limits_prefill_max_tokens_and_per_request_cap():
    policy = AdaptivePolicy(max_drafts=8, cost=None)
    prefilling = decoding_seq(0)
    prefilling.num_computed_tokens = 5
    near_end = decoding_seq(1, max_tokens=13)  # 10 generated, 3 left: 2 drafts + 1 more token
    capped = decoding_seq(2)
    capped.params.num_speculative_tokens = 3
    assert policy.num_drafts([prefilling, near_end, capped, decoding_seq(3)], 1000) == [0, 2, 3, 8]
    assert policy.num_drafts([decoding_seq(4)], max_model_len=22) == [1]


def test_an_expensive_draft_model_is_not_worth_running():
    seq = decoding_seq(0)
    cheap = AdaptivePolicy(max_drafts=4, cost=FLAT, draft_cost=StepCostModel([(1, 0.01)]))
    costly = AdaptivePolicy(max_drafts=4, cost=FLAT, draft_cost=StepCostModel([(1, 1.0)]))
    assert cheap.num_drafts([seq], 1000) == [4]
    assert costly.num_drafts([seq], 1000) == [0]


def test_a_draft_model_far_behind_pays_for_catching_up_first():
    """A draft forward over n tokens costs n times one over a token: drafting 4 for a sequence
    whose draft cache is 2 tokens behind pays off, 300 tokens behind it does not."""
    seq = decoding_seq(0)
    draft_cost = StepCostModel([(1, 0.01), (512, 5.12)])
    policy = AdaptivePolicy(max_drafts=4, cost=FLAT, draft_cost=draft_cost)
    assert policy.num_drafts([seq], 1000, backlog=lambda s: 2) == [4]
    assert policy.num_drafts([seq], 1000, backlog=lambda s: 300) == [0]
    assert policy.num_drafts([seq], 1000) == [4]  # no backlog given: one token per sequence


def test_cost_model_learns_real_step_times_and_stays_monotone():
    cost = StepCostModel([(1, 1.0), (128, 1.1)])  # start-up guess: drafts look almost free
    for _ in range(100):  # real steps say otherwise: 48 query tokens cost twice a 32-token step
        cost.observe(32, 1.0)
        cost.observe(48, 2.0)
    assert abs(cost(32) - 1.0) < 0.02 and abs(cost(48) - 2.0) < 0.02
    assert cost.num_observed == 200
    for _ in range(3):  # a size seen three times: its median is learned, the curve stays monotone
        cost.observe(1, 5.0)
    assert all(a <= b for a, b in zip(cost.times, cost.times[1:]))
    assert cost(1) == pytest.approx(1.8) and cost(2) >= cost(1)


def test_cost_model_ignores_stalled_steps_but_follows_a_real_change():
    cost = StepCostModel([(1, 1.0), (16, 1.5)])
    cost.observe(1, 9.0)
    assert cost(1) == 1.0  # one step alone teaches nothing
    for seconds in (1.0, 1.0, 1.0, 1.0, 9.0, 9.0):  # two stalls among steady steps: nothing
        cost.observe(1, seconds)
    assert cost(1) == 1.0
    cost.observe(1, 9.0)  # a third in a row: the machine got slower
    assert cost(1) == pytest.approx(1.0 + 0.2 * 8.0)


def test_stalled_steps_do_not_price_drafts_out():
    """A stalled step (the host: 3x a normal one) must not make drafting look dear for good:
    taken as it came, one stall at 2 query tokens priced a 1-draft step 40% above a decode, the
    policy stopped verifying drafts, and no later step at that size could correct the curve."""
    true_cost = {1: 1.0, 2: 1.01, 3: 1.02, 4: 1.1, 5: 1.2}
    policy = AdaptivePolicy(max_drafts=4, cost=StepCostModel(list(true_cost.items())))
    seq = decoding_seq(0)
    drafting_steps = 0
    for step in range(200):
        (k,) = policy.num_drafts([seq], 1000)
        drafting_steps += k > 0
        if k:  # a quarter of first drafts pass
            verified(policy, [seq], k, [int(step % 4 == 0)])
        policy.observe_step(1 + k, true_cost[1 + k] * (3.0 if step == 20 else 1.0))
    assert drafting_steps > 180


def test_a_size_priced_out_by_a_long_stall_is_tried_again():
    """Three stalled steps in a row at 2 query tokens teach the curve that a 1-draft step is
    dear; once no step of that size has been seen for a while, its knot drifts back to the
    start-up price, so the policy verifies a draft again and learns what it really costs."""
    cost = StepCostModel([(1, 1.0), (2, 1.01), (16, 1.5)])
    for _ in range(5):
        cost.observe(2, 3.0)
    assert cost(2) > 1.3
    for _ in range(StepCostModel.STALE):  # decodes only: the knot at 2 is not stale yet
        cost.observe(1, 1.0)
    assert cost(2) > 1.3
    for _ in range(500):
        cost.observe(1, 1.0)
    assert cost(2) < 1.05


def test_acceptance_is_the_ratio_of_passes_to_tests():
    """Steps of 3 drafts whose first failing test falls as a geometric law of rate 0.5 would
    have: the pass rate is 0.5 (7 passes in 14 tests per 8 steps). The mean of each step's own
    m / (m + 1) reads 0.33 and would keep drafts that pay from being verified."""
    policy = AdaptivePolicy(max_drafts=3, cost=FLAT)
    seq = decoding_seq(0)
    readings = []
    for _ in range(40):
        for accepted in (0, 0, 0, 0, 1, 1, 2, 3):
            verified(policy, [seq], 3, [accepted])
            readings.append(policy.class_acceptance[1])
    cycle = readings[-8:]
    assert sum(cycle) / len(cycle) == pytest.approx(0.5, abs=0.04)


def test_learned_costs_turn_drafting_off_in_a_busy_batch():
    """The start-up curve says drafts are free; measured verification steps say they are not."""
    policy = AdaptivePolicy(max_drafts=4, cost=StepCostModel([(1, 1.0), (256, 1.1)]))
    seqs = [decoding_seq(i) for i in range(32)]
    assert sum(policy.num_drafts(seqs, 1000)) > 0
    for _ in range(50):
        policy.observe_step(32, 1.0)
        policy.observe_step(64, 2.2)
        policy.observe_step(160, 5.0)
    assert policy.num_drafts(seqs, 1000) == [0] * 32


def test_learned_draft_costs_turn_an_expensive_draft_model_off():
    """Timed at start-up on a short context, a draft forward over 32 sequences looks cheap; the
    proposals the engine times say it costs twice a target step (attention over their long
    contexts), and drafting stops."""
    policy = AdaptivePolicy(
        max_drafts=4, cost=FLAT, draft_cost=StepCostModel([(1, 0.01), (32, 0.05)])
    )
    seqs = [decoding_seq(i) for i in range(32)]
    assert sum(policy.num_drafts(seqs, 1000)) > 0
    for _ in range(10):
        ks = policy.num_drafts(seqs, 1000)
        policy.observe_drafting(ks, seconds=max(ks) * 2.0)  # each draft forward: 2 s
    assert policy.num_drafts(seqs, 1000) == [0] * 32
    assert policy.draft_cost is not None and policy.draft_cost(32) > 0.5  # learnt, then stopped


def test_catch_up_is_not_taken_for_the_draft_forward_cost():
    """A proposal whose first forward fed 300 catch-up tokens per sequence teaches the cost of
    the others, not that every forward costs as much as a catch-up."""
    draft_cost = StepCostModel([(1, 0.01), (512, 5.12)])
    policy = AdaptivePolicy(max_drafts=4, cost=FLAT, draft_cost=draft_cost)
    seq = decoding_seq(0)
    assert policy.num_drafts([seq], 1000, backlog=lambda s: 30) == [4]
    for _ in range(5):  # 30 tokens of catch-up (0.30 s), then 4 forwards of one token
        policy.num_drafts([seq], 1000, backlog=lambda s: 30)
        policy.observe_drafting([4], seconds=draft_cost(30) + 3 * 0.01)
    assert draft_cost(1) == pytest.approx(0.01, rel=0.05)


def test_acceptance_is_kept_per_draft_class_and_class_zero_gets_nothing():
    classes = {0: 4, 1: 1, 2: 0}  # seq 0 matched a 4-gram, seq 1 a 1-gram, seq 2 nothing
    policy = AdaptivePolicy(
        max_drafts=4,
        cost=StepCostModel([(1, 1.0), (4, 1.02), (16, 1.5)]),
    )

    def classify(seq):
        return classes[seq.seq_id]

    seqs = [decoding_seq(i) for i in range(3)]
    assert policy.num_drafts(seqs, 1000, classify)[2] == 0
    for _ in range(1, 8):  # 4-gram drafts always pass, 1-gram drafts always fail
        policy.observe_verification(seqs, [4, 4, 0], [4, 0, 0])
        ks = policy.num_drafts(seqs, 1000, classify)
    assert ks[0] == 4 and ks[1] == 0 and ks[2] == 0
    assert policy.acceptance[0][4] > 0.9 and policy.acceptance[1][1] < 0.1
    # Class averages move slowly (many sequences feed them), and a new sequence starts there.
    assert policy.class_acceptance[4] > 0.6 > 0.4 > policy.class_acceptance[1]
    classes.update({3: 4, 4: 1})
    good_class, bad_class = policy.num_drafts([decoding_seq(3), decoding_seq(4)], 1000, classify)
    assert good_class > bad_class >= 1


def test_a_busy_batch_drafts_only_if_the_padded_step_pays():
    """Raising the depth pads every sequence: B more query tokens at once."""
    seqs = [decoding_seq(i) for i in range(32)]
    # 32 tokens cost 1.0; padding to 64 costs 1.3: worth it only if drafts gain > 30% tokens.
    cost = StepCostModel([(1, 0.5), (32, 1.0), (64, 1.3), (96, 1.6), (288, 6.0)])
    policy = AdaptivePolicy(max_drafts=8, cost=cost)
    policy.class_acceptance[1] = 0.2  # 0.2 expected tokens per sequence for 30% more time
    assert policy.num_drafts(seqs, 1000) == [0] * 32
    policy = AdaptivePolicy(max_drafts=8, cost=cost)
    policy.class_acceptance[1] = 0.9  # 0.9 + 0.81 expected tokens: depth 2 pays best
    assert policy.num_drafts(seqs, 1000) == [2] * 32


def test_a_drafter_known_to_agree_is_tried_where_an_unknown_one_is_not():
    """A draft forward costing 0.6 of a target step: at the default prior (0.5) no depth pays
    (1.5 tokens for 1.6 steps), so an unmeasured draft model never drafts; a drafter whose drafts
    are known to agree (quantized_self's prior, 0.9) drafts, and so gets measured."""
    seq = decoding_seq(0)
    draft_cost = StepCostModel([(1, 0.6)])
    unknown = AdaptivePolicy(max_drafts=4, cost=FLAT, draft_cost=draft_cost)
    agreeing = AdaptivePolicy(max_drafts=4, cost=FLAT, draft_cost=draft_cost, prior_acceptance=0.9)
    assert unknown.num_drafts([seq], 1000) == [0]
    assert agreeing.num_drafts([seq], 1000)[0] >= 2


def test_a_drafter_that_drafts_every_depth_in_one_pass_pays_for_one_forward():
    """Medusa's heads draft all depths in one pass: a draft cost of 0.25 target steps prices
    depth 4 at 0.25, not 1.0, so it drafts deeper than a drafter that runs once per depth."""
    seq = decoding_seq(0)
    draft_cost = StepCostModel([(1, 0.25)])
    per_depth = AdaptivePolicy(4, FLAT, draft_cost, prior_acceptance=0.6)
    one_pass = AdaptivePolicy(4, FLAT, draft_cost, prior_acceptance=0.6, drafts_in_one_pass=True)
    assert one_pass.num_drafts([seq], 1000) == [4]
    assert per_depth.num_drafts([seq], 1000)[0] < 4
