"""The draft-model drafter: its own KV on the shared block tables, exact outputs."""

import pytest

from specdec import LLM, SamplingParams
from specdec.drafters.policy import StepCostModel
from specdec.drafters.registry import UNCHECKED_CUDA_ENV
from specdec.runner import ATTENTION_BACKEND_ENV
from specdec.sequence import Sequence
from tests.tiny import byte_tokenizer, hf_greedy, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)) * 2, [7] * 13, [42]]


def spec(draft, k=4, adaptive=False):
    return {
        "drafter": "draft_model",
        "draft_model": draft,
        "draft_tokenizer": byte_tokenizer(),
        "num_speculative_tokens": k,
        "adaptive": adaptive,
    }


def test_target_as_its_own_draft_accepts_every_greedy_draft(make_llm):
    """If the draft KV were misplaced or stale, some drafts would be rejected."""
    llm = make_llm(block_size=4)
    llm = make_llm(block_size=4, speculative=spec(llm.hf_model))
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(llm.hf_model, prompt, GREEDY.max_tokens)
    stats = llm.engine.verifier.stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0


def test_target_as_its_own_draft_accepts_every_sampled_draft(make_llm):
    """q == p and the draft races with the target's noise of the position it drafts, so both
    races have the same winner (up to rounding between the two forwards): all accepted."""
    base = make_llm()
    llm = make_llm(speculative=spec(base.hf_model))
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=3, ignore_eos=True)
    llm.generate(PROMPTS, params)
    stats = llm.engine.verifier.stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.99


def test_weak_draft_keeps_greedy_output_with_preemption_and_prefix_cache(make_llm):
    draft = tiny_model("llama", seed=5, num_hidden_layers=1)
    llm = make_llm(
        block_size=4, num_kv_blocks=36, max_num_batched_tokens=24, speculative=spec(draft, k=3)
    )
    preemptions = 0
    for _ in range(2):
        outputs = llm.generate(PROMPTS, GREEDY)
        for prompt, out in zip(PROMPTS, outputs):
            assert out.token_ids == hf_greedy(llm.hf_model, prompt, GREEDY.max_tokens)
        preemptions += sum(o.metrics.num_preemptions for o in outputs)
    assert preemptions > 0
    assert llm.engine.verifier.stats.num_draft_tokens > 0


def test_adaptive_draft_model_stays_exact(make_llm):
    """The draft model is the target itself, so drafting never pays; a start-up curve that says
    draft forwards are free makes the policy draft until the proposals it times teach it."""
    base = make_llm()
    llm = make_llm(speculative=spec(base.hf_model, k=6, adaptive=True))
    llm.engine.policy.draft_cost = StepCostModel([(1, 1e-6), (64, 1e-6)])
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(llm.hf_model, prompt, GREEDY.max_tokens)
    draft_cost = llm.engine.policy.draft_cost
    assert llm.engine.verifier.stats.num_draft_tokens > 0
    assert draft_cost is not None and draft_cost.num_observed > 0  # timed real proposals
    assert max(draft_cost.times) > 1e-5  # and learnt from them


def test_vocabulary_mismatch_is_a_clear_error():
    target = tiny_model("llama")
    draft = tiny_model("llama", vocab_size=320)
    with pytest.raises(ValueError, match="vocabulary .320 tokens. differs from the target's .300"):
        LLM(target, tokenizer=byte_tokenizer(), speculative=spec(draft))


def test_catch_up_counts_what_the_draft_cache_lacks(make_llm):
    """New sequences count 1 (their prompt is not priced); then every token the draft model has
    not fed, from its first stale one (a rejected draft it fed) on."""
    base = make_llm()
    drafter = make_llm(speculative=spec(base.hf_model)).engine.drafter
    seq = Sequence(0, list(range(12)), 12, GREEDY)
    assert drafter.catch_up_tokens(seq) == 1
    drafter.fed[seq.seq_id] = list(range(5))  # fed 5 tokens, then drafting stopped
    assert drafter.catch_up_tokens(seq) == 7
    drafter.fed[seq.seq_id] = [0, 1, 99, 3, 4]  # position 2 held a draft that was rejected
    assert drafter.catch_up_tokens(seq) == 10
    drafter.fed[seq.seq_id] = list(range(20))  # all fed, and more: the last is fed again
    assert drafter.catch_up_tokens(seq) == 1
    drafter.forget(seq)
    assert drafter.catch_up_tokens(seq) == 1


@pytest.mark.cuda  # selected by make gpu-check
def test_a_draft_model_is_exact_on_the_cuda_path(make_llm, monkeypatch):
    """On a GPU where there is one (the draft model is let through though not yet checked
    there); without, the CUDA path in the CPU engine, which the draft model's runner takes too.
    Greedy and seeded output are plain decoding's."""
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    monkeypatch.setenv(UNCHECKED_CUDA_ENV, "1")
    plain = make_llm(block_size=4)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=30)] * 2
    reference = [o.token_ids for o in plain.generate(PROMPTS, params)]
    llm = make_llm(block_size=4, speculative=spec(plain.hf_model))
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == reference
    assert llm.engine.verifier.stats.num_accepted_tokens > 0
    draft_runner = llm.engine.drafter.runner
    assert draft_runner.triton_attention
    assert draft_runner.k_caches[0].device == llm.engine.runner.k_caches[0].device
