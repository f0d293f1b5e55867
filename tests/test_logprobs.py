"""Logprobs: each generated token's log-probability under the model, the same with a drafter."""

import pytest
import torch

from specdec import SamplingParams
from specdec.config import MAX_LOGPROBS
from specdec.sampling import token_logprobs

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)) * 2, [7] * 13, [200]]
LOOKUP = {"drafter": "prompt_lookup", "num_speculative_tokens": 5, "adaptive": False}


def test_logprobs_are_the_log_softmax_of_the_rows_the_tokens_came_from(make_llm):
    llm = make_llm()
    for temperature in (0.0, 0.8):
        params = SamplingParams(
            temperature=temperature, seed=3, max_tokens=12, logprobs=4, return_logits=True
        )
        out = llm.generate(PROMPTS[:2], params)
        for o in out:
            assert o.logprobs is not None and o.logits is not None
            assert [lp.token_id for lp in o.logprobs] == o.token_ids
            expected = torch.log_softmax(o.logits.float(), dim=-1)
            for row, lp in zip(expected, o.logprobs):
                assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-6)
                assert lp.rank == 1 + int((row > row[lp.token_id]).sum())
                values, ids = row.topk(4)
                assert [t for t, _ in lp.top] == ids.tolist()
                assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-6)
                if temperature == 0:  # greedy takes the most likely token
                    assert lp.rank == 1 and lp.top[0][0] == lp.token_id


def test_logprobs_zero_gives_the_chosen_token_alone_and_none_gives_nothing(make_llm):
    llm = make_llm()
    alone, none = llm.generate(
        [PROMPTS[0]] * 2,
        [SamplingParams(temperature=0, max_tokens=5, logprobs=0), SamplingParams(max_tokens=5)],
    )
    assert alone.logprobs is not None and len(alone.logprobs) == 5
    assert all(lp.top == () and lp.logprob <= 0 for lp in alone.logprobs)
    assert none.logprobs is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_returns_the_logprobs_of_plain_decoding(make_llm, temperature):
    """Drafted or not, a token's logprob comes from the same logit row: batched, prompt lookup
    accepting several drafts per step, a stop cutting a step's tokens short."""
    params = [
        SamplingParams(temperature=temperature, seed=s, max_tokens=m, logprobs=3, ignore_eos=True)
        for s, m in zip(range(4), (30, 17, 30, 9))
    ]
    plain = make_llm(block_size=4).generate(PROMPTS, params)
    spec_llm = make_llm(speculative=LOOKUP, block_size=4)
    spec = spec_llm.generate(PROMPTS, params)
    assert spec_llm.engine.verifier.stats.num_accepted_tokens > 0
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        assert s.logprobs is not None and len(s.logprobs) == len(s.token_ids)
        assert s.logprobs == p.logprobs


def test_streamed_logprobs_add_up_to_the_full_output(make_llm):
    llm = make_llm(speculative=LOOKUP, enable_prefix_caching=False)  # the same prefill twice
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True)
    full = llm.generate(PROMPTS[1], params)[0]
    streamed = [lp for delta in llm.stream(PROMPTS[1], params) for lp in delta.logprobs or []]
    assert streamed == full.logprobs


def test_token_logprobs_of_a_row():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 5.0, -1.0]])
    first, second = token_logprobs(logits, [2, 1], 2)
    assert first.rank == 2 and [t for t, _ in first.top] == [1, 2]
    assert second.rank == 1  # ties rank together: nothing is strictly more likely
    assert second.logprob == pytest.approx(torch.log_softmax(logits[1], -1)[1].item())


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 1.5, "3"])
def test_bad_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match="logprobs must be None or an integer in"):
        SamplingParams(logprobs=bad)
