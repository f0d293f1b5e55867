"""Prompt logprobs: each prompt token's log-probability given the tokens before it (vLLM's
``prompt_logprobs``), whatever the chunking, the prefix cache, preemption or the drafter."""

import pytest
import torch

from specdec import SamplingParams
from specdec.config import MAX_LOGPROBS

PROMPTS = [list(range(10, 40)) * 3, [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [7] * 13, [200]]


def reference(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax rows: row i decides prompt token i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches_reference(out, hf_model, num_top: int) -> None:  # noqa: ANN001
    prompt = out.prompt_token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None  # nothing precedes the first token
    rows = reference(hf_model, prompt)
    for token, row, lp in zip(prompt[1:], rows, out.prompt_logprobs[1:], strict=True):
        assert lp is not None and lp.token_id == token
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
        surely_above, maybe_above = (int((row > row[token] + d).sum()) for d in (1e-4, -1e-4))
        assert 1 + surely_above <= lp.rank <= 1 + maybe_above  # near-ties may order either way
        values, ids = row.topk(num_top)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [1024, 7])  # one chunk, or chunks of 7 tokens beside decodes
def test_prompt_logprobs_are_the_models_log_softmax_at_every_prompt_position(make_llm, budget):
    llm = make_llm(block_size=4, max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
    for out in llm.generate(PROMPTS, params):
        assert_matches_reference(out, llm.hf_model, 3)


def test_a_prompt_of_one_token_has_only_the_empty_first_entry(make_llm):
    out = make_llm().generate([[5]], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert out.prompt_logprobs == [None]


def test_no_prompt_logprobs_unless_asked(make_llm):
    out = make_llm().generate([PROMPTS[1]], SamplingParams(max_tokens=2, logprobs=1))[0]
    assert out.prompt_logprobs is None and out.logprobs is not None


def test_a_cached_prefix_is_computed_again_for_a_request_that_asks(make_llm):
    """Positions served from the prefix cache compute nothing, so a request with
    prompt_logprobs skips the cache; one without still hits it."""
    llm = make_llm(block_size=4)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    first = llm.generate([PROMPTS[0]], params)[0]
    again, plain = llm.generate([PROMPTS[0]] * 2, [params, SamplingParams(max_tokens=3)])
    assert again.metrics.num_cached_tokens == 0 and plain.metrics.num_cached_tokens > 0
    assert again.prompt_logprobs == first.prompt_logprobs
    assert_matches_reference(again, llm.hf_model, 2)


def test_preemption_scores_each_prompt_token_once(make_llm):
    llm = make_llm(block_size=4, num_kv_blocks=40, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(PROMPTS * 2, params)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    for out in outputs:
        assert_matches_reference(out, llm.hf_model, 1)


def test_scoring_the_output_as_a_prompt_gives_the_logprobs_it_was_generated_with(make_llm):
    llm = make_llm(speculative={"drafter": "prompt_lookup", "num_speculative_tokens": 4})
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, logprobs=2))[0]
    scored = llm.generate(
        out.prompt_token_ids + out.token_ids, SamplingParams(max_tokens=1, prompt_logprobs=2)
    )[0]
    assert scored.prompt_logprobs is not None and out.logprobs is not None
    tail = scored.prompt_logprobs[len(out.prompt_token_ids) :]
    for generated, rescored in zip(out.logprobs, tail, strict=True):
        assert rescored is not None and rescored.token_id == generated.token_id
        assert rescored.logprob == pytest.approx(generated.logprob, abs=1e-4)
        assert [t for t, _ in rescored.top] == [t for t, _ in generated.top]


def test_only_the_first_streamed_delta_carries_them(make_llm):
    llm = make_llm(max_num_batched_tokens=16)  # the prompt takes several steps
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    full = llm.generate(PROMPTS[0], params)[0]
    deltas = list(llm.stream(PROMPTS[0], params))
    assert len(deltas) > 1
    assert deltas[0].prompt_logprobs == full.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 1.5, "3"])
def test_bad_prompt_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs must be None or an integer in"):
        SamplingParams(prompt_logprobs=bad)
