"""Prompt lookup first, a model drafter elsewhere: exact output, one source per sequence and
step, lookup-only steps priced without the model's forwards, and clear errors."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from specdec import SamplingParams
from specdec.cli import main
from specdec.drafters import SpecConfig
from specdec.drafters.base import DrafterBase
from specdec.drafters.lookup_first import LOOKUP_CLASS, LookupFirst
from specdec.drafters.policy import AdaptivePolicy, StepCostModel
from specdec.drafters.prompt_lookup import PromptLookupDrafter, find_match
from specdec.eval.bench.systems import available_drafters, engine_systems
from specdec.sequence import Sequence
from tests.tiny import byte_tokenizer, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=5, ignore_eos=True)
# repeats (lookup matches from the start), no repeats (the model drafts), a lone token
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)), [42], [5, 9] * 6 + [7]]


def spy(llm) -> dict[str, int]:
    """Count the drafts each source of ``llm``'s LookupFirst drafter proposes."""
    drafter, counts = llm.engine.drafter, {"model": 0, "lookup": 0}
    for name, source in (("model", drafter.inner), ("lookup", drafter.lookup)):

        def counting(seqs, ks, step=None, _propose=source.propose, _name=name):
            _propose(seqs, ks, step)
            counts[_name] += sum(len(s.spec_token_ids) for s, k in zip(seqs, ks) if k)

        source.propose = counting
    return counts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16},  # prompts in chunks beside decodes and verifications
        {"num_kv_blocks": 24},  # preemption: sequences recomputed, their drafts restarted
    ],
)
def test_output_equals_plain_decoding_with_both_sources_drafting(make_llm, dtype, options):
    plain = make_llm(dtype=dtype, block_size=4, **options)
    spec = SpecConfig("quantized_self", 6, adaptive=False, lookup_first=2)
    fast = make_llm(dtype=dtype, block_size=4, speculative=spec, **options)
    assert fast.engine.drafter.name == "quantized_self+lookup"
    counts = spy(fast)
    for params in (GREEDY, SAMPLED):
        expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
        assert [o.token_ids for o in fast.generate(PROMPTS, params)] == expected
    assert counts["model"] > 0 and counts["lookup"] > 0
    assert fast.engine.verifier.stats.num_accepted_tokens > 0


def test_the_policy_keeps_acceptance_per_source(make_llm):
    plain = make_llm()
    fast = make_llm(speculative=SpecConfig("quantized_self", 4, adaptive=False, lookup_first=2))
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in fast.generate(PROMPTS, GREEDY)] == expected
    classes = set(fast.engine.policy.class_acceptance)
    assert 1 in classes  # the model's drafts
    assert any(c > LOOKUP_CLASS for c in classes)  # lookup's, by the matched n-gram's length


class FixedModelDrafter(DrafterBase):
    """A 'model' drafter that always proposes token 99 and records, for each sequence, its
    tokens and the drafts it was asked for."""

    name = "fixed"

    def __init__(self) -> None:
        self.asked: list[tuple[list[int], int]] = []
        self.draft_forward = lambda n: None

    def propose(self, seqs, num_drafts, step=None):
        for seq, k in zip(seqs, num_drafts):
            self.asked.append((list(seq.token_ids), k))
            seq.spec_token_ids = [99] * k


def test_each_sequence_gets_lookup_or_the_model_never_both(make_llm):
    inner = FixedModelDrafter()
    llm = make_llm(speculative=SpecConfig(inner, 4, adaptive=False, lookup_first=2))
    prompts = [[1, 2, 3, 1, 2], [20, 21, 22, 23], [5, 6] * 5]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    drafter = llm.engine.drafter
    assert isinstance(drafter, LookupFirst) and drafter.inner is inner
    matched = [find_match(tokens, 2, 4)[0] > 0 for tokens, _ in inner.asked]
    # the model is asked for drafts only where the last 2 tokens were not seen before (and
    # for none at the end of a request, where no draft could be used)
    assert not any(k and m for (_, k), m in zip(inner.asked, matched))
    assert any(matched) and any(k for _, k in inner.asked)
    assert drafter.runs_model(1) and not drafter.runs_model(LOOKUP_CLASS + 2)


def test_lookup_drafts_only_where_the_policy_values_it_above_the_model():
    """A draft forward costs a fifth of a target step here: a match accepted 0.9 of the time
    (free) beats the model at 0.95; one accepted 0.3 of the time loses to it."""
    flat = StepCostModel([(1, 0.010), (128, 0.010)])
    policy = AdaptivePolicy(8, flat, draft_cost=StepCostModel([(1, 0.002), (32, 0.002)]))
    drafter = LookupFirst(FixedModelDrafter(), 2)
    drafter.policy = policy
    seq = Sequence(0, [1, 2, 3, 4, 1, 2], 6, SamplingParams(temperature=0))
    policy.class_acceptance = {1: 0.95, LOOKUP_CLASS + 2: 0.9}
    assert drafter.draft_class(seq) == LOOKUP_CLASS + 2
    policy.class_acceptance[LOOKUP_CLASS + 2] = 0.3
    seq.token_ids = [1, 2, 3, 4, 1, 2, 3, 9, 1, 2]  # the same match, one step later
    assert drafter.draft_class(seq) == 1
    seq.token_ids = [1, 2, 3, 4, 5]  # no match: the model
    assert drafter.draft_class(seq) == 1


def test_a_lookup_class_starts_from_its_own_prior(make_llm):
    """Before any is measured, a 4-gram match is assumed accepted far more often than a
    1-gram one (prompt lookup's measurements), not at the model's prior."""
    llm = make_llm(speculative=SpecConfig("quantized_self", lookup_first=1))
    policy = llm.engine.policy
    assert llm.engine.drafter.policy is policy
    assert policy.prior(1) == llm.engine.drafter.prior_acceptance == 0.9
    assert policy.prior(LOOKUP_CLASS + 1) < policy.prior(LOOKUP_CLASS + 4) < 0.9
    # whatever the policy chooses, step by step, the output is plain decoding's
    plain = make_llm()
    for params in (GREEDY, SAMPLED):
        expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected


def test_a_step_drafted_by_lookup_alone_costs_no_model_forwards():
    flat = StepCostModel([(1, 0.010), (128, 0.010)])  # verifying is free: only drafting costs
    policy = AdaptivePolicy(8, flat, draft_cost=StepCostModel([(1, 0.050), (32, 0.050)]))
    assert policy._allocate([0.9], [8], 0, [True]) == [0]  # 50 ms a draft: not worth it
    assert policy._allocate([0.9], [8], 0, [False]) == [8]  # lookup's drafts are free
    # a step's drafting time teaches the model's cost only through the model's sequences
    policy.modelled = [False, True]
    before = policy.draft_cost(1)
    for _ in range(5):
        policy.observe_drafting([8, 0], 1.0)  # only lookup drafted: nothing to learn
    assert policy.draft_cost(1) == before


def test_bad_lookup_first_is_refused():
    with pytest.raises(ValueError, match="lookup_first must be an n-gram length from 1 to 4"):
        SpecConfig("quantized_self", lookup_first=0)
    with pytest.raises(ValueError, match="lookup_first must be an n-gram length"):
        SpecConfig("quantized_self", lookup_first=5)
    with pytest.raises(ValueError, match="prompt_lookup already looks up every draft"):
        SpecConfig("prompt_lookup", lookup_first=2)
    with pytest.raises(ValueError, match="needs a drafter with a model of its own"):
        LookupFirst(PromptLookupDrafter(), 2)
    result = CliRunner().invoke(
        main, ["generate", "--drafter", "prompt_lookup", "--lookup-first", "2", "hi"]
    )
    assert result.exit_code == 2 and "prompt_lookup already looks up" in result.output


def test_the_bench_runs_quantized_self_with_lookup_first():
    assert "quantized_self+lookup" in available_drafters(None, None, {})
    model, tokenizer = tiny_model(), byte_tokenizer()
    systems = engine_systems(model, "float32", ["quantized_self+lookup"], [4], tokenizer=tokenizer)
    drafter = systems[1].llm.engine.drafter
    assert systems[1].name == "quantized_self+lookup" and isinstance(drafter, LookupFirst)
    assert drafter.lookup.min_n == 2
