"""Speculation in the engine: greedy output unchanged, sampling law unchanged, KV intact."""

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from specdec import SamplingParams, SpecConfig
from specdec.drafters import DrafterBase
from specdec.sampling import process_logits_for
from specdec.sequence import Sequence
from specdec.verifier import Verifier
from tests.tiny import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
REPETITIVE = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)) * 2, [7] * 13, [200]]
FIXED_K = {"drafter": "prompt_lookup", "num_speculative_tokens": 5, "adaptive": False}


class ScriptedDrafter(DrafterBase):
    """Proposes the reference continuation, corrupted at chosen draft positions.

    Every step then accepts a known number of drafts and rejects the next, so a rollback that
    kept one position too many or too few would misplace KV and change the output.
    """

    name = "scripted"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], k: int, wrong_at: int):
        self.reference, self.k, self.wrong_at = reference, k, wrong_at

    def propose(self, seqs: list[Sequence], num_drafts: list[int], step=None) -> None:
        for seq, k in zip(seqs, num_drafts):
            future = self.reference[tuple(seq.prompt_token_ids)][seq.num_output_tokens :]
            drafts = future[: min(k, self.k)]
            if len(drafts) > self.wrong_at:
                drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % 256
            seq.spec_token_ids = drafts


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prompt_lookup_greedy_equals_plain_decoding(make_llm, arch):
    llm = make_llm(arch, speculative=FIXED_K, block_size=4)
    outputs = llm.generate(REPETITIVE, GREEDY)
    for prompt, out in zip(REPETITIVE, outputs):
        assert out.token_ids == hf_greedy(llm.hf_model, prompt, GREEDY.max_tokens)
    stats = llm.engine.verifier.stats
    assert stats.num_draft_tokens > 0
    assert sum(o.metrics.num_draft_tokens for o in outputs) == stats.num_draft_tokens


@pytest.mark.parametrize("wrong_at", [0, 1, 3])
def test_rollback_keeps_exactly_the_accepted_positions(make_llm, wrong_at):
    plain = make_llm(block_size=4)
    reference = {tuple(p): hf_greedy(plain.hf_model, p, GREEDY.max_tokens) for p in REPETITIVE}
    drafter = ScriptedDrafter(reference, k=5, wrong_at=wrong_at)
    llm = make_llm(speculative=SpecConfig(drafter, 5, adaptive=False), block_size=4)
    outputs = llm.generate(REPETITIVE, GREEDY)
    assert [o.token_ids for o in outputs] == [reference[tuple(p)] for p in REPETITIVE]
    stats = llm.engine.verifier.stats
    assert stats.accepted_per_position[wrong_at] == 0
    assert all(stats.acceptance_per_position[j] == 1.0 for j in range(wrong_at))


def test_speculation_with_preemption_chunking_and_prefix_cache(make_llm):
    llm = make_llm(speculative=FIXED_K, block_size=4, num_kv_blocks=30, max_num_batched_tokens=16)
    for _ in range(2):
        outputs = llm.generate(REPETITIVE, GREEDY)
        for prompt, out in zip(REPETITIVE, outputs):
            assert out.token_ids == hf_greedy(llm.hf_model, prompt, GREEDY.max_tokens)
    assert llm.engine.verifier.stats.num_accepted_tokens > 0


def test_stop_inside_an_accepted_run_drops_the_tokens_after_it(make_llm):
    llm = make_llm(speculative=FIXED_K)
    plain = llm.generate([REPETITIVE[2]], GREEDY)[0].token_ids
    stop_token = plain[6]
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token])
    out = llm.generate([REPETITIVE[2]], params)[0]
    assert out.token_ids == plain[: plain.index(stop_token) + 1]
    short = llm.generate(
        [REPETITIVE[2]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    )[0]
    assert short.token_ids == plain[:7] and short.finish_reason == "length"


def test_per_request_cap_turns_speculation_off(make_llm):
    llm = make_llm(speculative=FIXED_K)
    off = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, num_speculative_tokens=0)
    out = llm.generate([REPETITIVE[2]], off)[0]
    assert out.metrics.num_draft_tokens == 0


def test_adaptive_policy_drafts_for_repetitive_text(make_llm):
    llm = make_llm(speculative={"drafter": "prompt_lookup", "num_speculative_tokens": 4})
    out = llm.generate([REPETITIVE[2]], GREEDY)[0]
    assert out.token_ids == hf_greedy(llm.hf_model, REPETITIVE[2], GREEDY.max_tokens)
    assert out.metrics.num_steps < GREEDY.max_tokens
    policy = llm.engine.policy
    assert policy.cost.num_observed >= out.metrics.num_steps - 1  # every decode/verify step
    assert policy.class_acceptance  # acceptance kept per matched n-gram length


def test_bad_spec_config_is_rejected():
    with pytest.raises(ValueError, match="unknown drafter"):
        SpecConfig(drafter="magic")
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive"):
        SpecConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="needs draft_model"):
        SpecConfig(drafter="draft_model")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpecConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="'prompt_lookup' has no option 'draft_model'"):
        SpecConfig("prompt_lookup", draft_model="somewhere")
    with pytest.raises(ValueError, match="a drafter object takes no options"):
        SpecConfig(DrafterBase(), draft_model="somewhere")
    with pytest.raises(ValueError, match="num_speculative_tokens must be a non-negative"):
        SamplingParams(num_speculative_tokens=-1)


class RandomDrafter(DrafterBase):
    """Drafts tokens drawn from a fixed distribution q over a few tokens, from its own generator.

    Its drafts do not depend on the target's noise, so verification must keep the target's law
    whatever q is; q is peaked, so that it is often far from p.
    """

    name = "random"

    def __init__(self, tokens: list[int], vocab: int):
        self.q = torch.zeros(vocab)
        self.q[tokens] = 0.5 ** torch.arange(len(tokens), dtype=torch.float)
        self.q /= self.q.sum()
        self.rng = torch.Generator().manual_seed(0)

    def propose(self, seqs, num_drafts, step=None):
        for seq, k in zip(seqs, num_drafts):
            drafts = torch.multinomial(self.q, max(k, 1), replacement=True, generator=self.rng)
            seq.spec_token_ids = drafts.tolist()[:k]


class LenientVerifier(Verifier):
    """A wrong acceptance rule: a draft the target could emit at its row (p(d) > 0) is accepted
    as if the target had drawn it."""

    def _row_tokens(self, seqs, logits, j):
        tokens = super()._row_tokens(seqs, logits, j)
        probs = process_logits_for(logits, [s.params for s in seqs])
        for row, seq in enumerate(seqs):
            if j < len(seq.spec_token_ids) and probs[row, seq.spec_token_ids[j]] > 0:
                tokens[row] = seq.spec_token_ids[j]
        return tokens


def continuations(llm, prompt, params, num_samples, seed):
    torch.manual_seed(seed)  # each unseeded request draws its noise seed from the global RNG
    outputs = llm.generate([prompt] * num_samples, params)
    return [tuple(o.token_ids) for o in outputs]


def law_pvalue(make_llm, verifier_class):
    """Two-sample chi-square on the 4 generated tokens; positions 2-4 go through verification."""
    prompt = REPETITIVE[0]
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=4, ignore_eos=True)
    options = {"max_num_seqs": 1024, "max_num_batched_tokens": 16384}
    plain = make_llm(**options)
    n = 4000
    a = continuations(plain, prompt, params, n, seed=1)
    counts = Counter(t for outcome in a for t in outcome)
    seen = [t for t, _ in counts.most_common()]
    drafter = RandomDrafter(seen, plain.engine.vocab_size)
    spec = make_llm(**options, speculative=SpecConfig(drafter, 5, adaptive=False))
    spec.engine.verifier = verifier_class()  # the rule under test (a wrong one must fail)
    b = continuations(spec, prompt, params, n, seed=2)
    stats = spec.engine.verifier.stats
    assert stats.num_draft_tokens >= n and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    outcomes = sorted(set(a) | set(b))
    table = np.array([[a.count(o) for o in outcomes], [b.count(o) for o in outcomes]])
    table = table[:, table.sum(axis=0) >= 10]  # pool rare outcomes out of the test
    return chi2_contingency(table).pvalue


def test_sampled_continuations_follow_the_same_law_with_and_without_speculation(make_llm):
    assert law_pvalue(make_llm, Verifier) > 1e-4


def test_the_law_check_detects_a_wrong_acceptance_rule(make_llm):
    assert law_pvalue(make_llm, LenientVerifier) < 1e-12
