from specdec.config import SamplingParams
from specdec.drafters.policy import AdaptivePolicy, StepCostModel
from specdec.sequence import Sequence


def decoding_seq(seq_id: int, max_tokens: int = 100, drafted: int = 0, accepted: int = 0):
    seq = Sequence(seq_id, list(range(20)), 10, SamplingParams(max_tokens=max_tokens))
    seq.num_computed_tokens = seq.num_tokens - 1  # fully prefilled, decoding
    seq.metrics.num_draft_tokens, seq.metrics.num_accepted_tokens = drafted, accepted
    return seq


FLAT = StepCostModel([(1, 1.0), (64, 1.05), (128, 1.1)])  # weight-bound: drafts nearly free
STEEP = StepCostModel([(1, 1.0), (2, 2.0), (128, 128.0)])  # compute-bound: every token costs


def test_cost_model_interpolates_and_extrapolates():
    cost = StepCostModel([(1, 1.0), (9, 2.0)])
    assert cost(1) == 1.0 and cost(5) == 1.5 and cost(17) == 3.0 and cost(0) == 1.0


def test_cheap_steps_and_good_acceptance_get_the_full_k():
    policy = AdaptivePolicy(max_drafts=8, cost=FLAT)
    seqs = [decoding_seq(0), decoding_seq(1)]
    policy.num_drafts(seqs, 1000)  # first look: prior acceptance
    for seq in seqs:
        seq.metrics.num_draft_tokens, seq.metrics.num_accepted_tokens = 8, 8
    assert policy.num_drafts(seqs, 1000) == [8, 8]


def test_compute_bound_steps_get_no_drafts():
    policy = AdaptivePolicy(max_drafts=8, cost=STEEP)
    assert policy.num_drafts([decoding_seq(i) for i in range(4)], 1000) == [0, 0, 0, 0]


def test_failing_drafts_shrink_k_and_passing_ones_keep_it():
    policy = AdaptivePolicy(max_drafts=8, cost=StepCostModel([(1, 1.0), (128, 3.0)]))
    good, bad = decoding_seq(0), decoding_seq(1)
    for step in range(1, 6):
        good.metrics.num_draft_tokens = bad.metrics.num_draft_tokens = 8 * step
        good.metrics.num_accepted_tokens = 8 * step
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
