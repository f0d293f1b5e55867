"""A request's own logits processors (vLLM's ``SamplingParams.logits_processors``; transformers'
``generate(logits_processor=...)`` through ``wrap``): applied to every row a token is decided
from, with the drafts before the row counted, so that drafters change nothing; bad ones get a
clear error and leave nothing behind."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import specdec
from specdec import SamplingParams
from tests.test_token_constraints import PROMPTS, same_with_drafters
from tests.test_wrap import TEXTS, left_padded, model_and_tokenizer


def no_immediate_repeat(output: list[int], logits: torch.Tensor) -> torch.Tensor:
    """vLLM's two-argument form: the last output token may not come again at once."""
    if output:
        logits[output[-1]] = float("-inf")
    return logits


def favour_by_position(prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
    """The three-argument form, a new tensor: a token that depends on the prompt and the
    position gains 4."""
    bonus = torch.zeros_like(logits)
    bonus[(prompt[0] * 7 + len(output) * 13) % logits.shape[0]] = 4.0
    return logits + bonus


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_processors_hold_and_drafters_change_nothing(make_llm, temperature):
    def params(processors):  # noqa: ANN001, ANN202
        return [
            SamplingParams(
                temperature=temperature, seed=s, max_tokens=24, ignore_eos=True,
                logits_processors=processors,
            )
            for s in range(len(PROMPTS))
        ]  # fmt: skip

    outputs = same_with_drafters(make_llm, params([no_immediate_repeat, favour_by_position]))
    assert all(a != b for out in outputs for a, b in zip(out, out[1:]))
    plain = [o.token_ids for o in make_llm(block_size=4).generate(PROMPTS, params(None))]
    assert any(a == b for out in plain for a, b in zip(out, out[1:]))  # the rule does bind
    assert outputs != plain


def test_bad_processors_are_refused_and_leave_nothing_behind(make_llm):
    with pytest.raises(ValueError, match="logits_processors must be a list of callables"):
        SamplingParams(logits_processors=["not a function"])
    llm = make_llm()
    free = llm.engine.num_free_blocks
    wrong = SamplingParams(max_tokens=4, logits_processors=[lambda output, logits: logits[:5]])
    with pytest.raises(
        ValueError, match=r"a logits processor returned \(5,\), not a \[\d+\] tensor"
    ):
        llm.generate(PROMPTS, wrong)
    assert llm.engine.num_free_blocks == free and not llm.engine.has_unfinished()
    again = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6))
    fresh = make_llm().generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6))
    assert [o.token_ids for o in again] == [o.token_ids for o in fresh]


class FavourNext(LogitsProcessor):
    """A transformers processor that reads its ``input_ids``: the token after the last one (by
    id) gains 3, a token of the last 4 positions loses 2."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids):
            scores[row, ids[-4:]] -= 2.0
            scores[row, (ids[-1] + 1) % scores.shape[1]] += 3.0
        return scores


@pytest.mark.parametrize("mode", ["greedy", "beams"])
def test_wrap_passes_transformers_processors(mode):
    model, tokenizer = model_and_tokenizer()
    fast = specdec.wrap(model, tokenizer)
    ids = torch.tensor([tokenizer.encode(TEXTS[1])])
    options = dict(
        max_new_tokens=12, return_dict_in_generate=True, output_scores=True,
        logits_processor=LogitsProcessorList([FavourNext()]),
        **{"greedy": dict(do_sample=False), "beams": dict(num_beams=3, do_sample=False, pad_token_id=0)}[mode],
    )  # fmt: skip
    expected = model.generate(ids, **options)
    got = fast.generate(ids, **options)
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs in zip(got.scores, expected.scores):
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        torch.testing.assert_close(
            ours.nan_to_num(0, 0, 0), theirs.nan_to_num(0, 0, 0), atol=1e-4, rtol=0
        )
    plain = fast.generate(ids, **{k: v for k, v in options.items() if k != "logits_processor"})
    assert not torch.equal(plain.sequences, got.sequences)  # the processor does change it


def test_wrap_processors_with_a_drafter_and_a_batch():
    model, tokenizer = model_and_tokenizer()
    fast = specdec.wrap(model, tokenizer)
    batch = [torch.tensor([tokenizer.encode(t)]) for t in TEXTS]
    procs = LogitsProcessorList([FavourNext()])
    expected = [
        model.generate(ids, max_new_tokens=16, do_sample=False, logits_processor=procs)
        for ids in batch
    ]
    for ids, want in zip(batch, expected):  # one row at a time: transformers' ids hold no padding
        got = fast.generate(
            ids, max_new_tokens=16, prompt_lookup_num_tokens=4, logits_processor=procs
        )
        assert torch.equal(got, want)
    ids, mask = left_padded(tokenizer, TEXTS)  # a batch on the engine: each row as alone
    together = fast.generate(ids, attention_mask=mask, max_new_tokens=16, logits_processor=procs)
    for row, want in zip(together, expected):
        assert row[-16:].tolist() == want[0, -16:].tolist()
