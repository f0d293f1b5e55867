"""``specdec.wrap(model).generate(stopping_criteria=..., max_time=...)``: transformers' stopping
criteria end each row at the token after which one holds, that token kept, with drafts, in a
batch, streamed and in beam search."""

from __future__ import annotations

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

import specdec
from tests.test_wrap import TEXTS, left_padded, model_and_tokenizer


class EndsWith(StoppingCriteria):
    """Done where the last token is one of ``ids``."""

    def __init__(self, ids: list[int]):
        self.ids = torch.tensor(ids)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:  # noqa: ANN001
        return torch.isin(input_ids[:, -1], self.ids)


def stop_ids(model, tokenizer) -> list[int]:  # noqa: ANN001
    """Tokens that the greedy outputs of TEXTS reach after a few steps (so rows end early)."""
    ids, mask = left_padded(tokenizer, TEXTS)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    return [int(row[ids.shape[1] + 4 + i]) for i, row in enumerate(free)]


def with_criteria():  # noqa: ANN201
    """The model, its wrap, criteria that end each row of TEXTS early, and TEXTS padded."""
    model, tokenizer = model_and_tokenizer()
    criteria = StoppingCriteriaList([EndsWith(stop_ids(model, tokenizer))])
    return (
        model,
        tokenizer,
        specdec.wrap(model, tokenizer),
        criteria,
        *left_padded(tokenizer, TEXTS),
    )


def test_criteria_end_rows_as_transformers_does():
    model, tokenizer, fast, criteria, ids, mask = with_criteria()
    options = dict(
        attention_mask=mask, max_new_tokens=20, do_sample=False, stopping_criteria=criteria
    )
    expected = model.generate(ids, **options)
    assert expected.shape[1] < ids.shape[1] + 20  # every row did stop early
    assert torch.equal(fast.generate(ids, **options), expected)
    # drafts past the stop are dropped: prompt lookup, and the model as its own assistant (its
    # drafts all accepted, 6 tokens a step), give the same rows
    assert torch.equal(fast.generate(ids, prompt_lookup_num_tokens=6, **options), expected)
    assisted = fast.generate(ids, assistant_model=model, num_assistant_tokens=6, **options)
    assert torch.equal(assisted, expected)
    assert fast._llm.engine.verifier.stats.num_accepted_tokens > 0
    for row in range(len(TEXTS)):  # the streamed row, and what the streamer was handed
        one = torch.tensor([tokenizer.encode(TEXTS[row])])
        want = model.generate(one, max_new_tokens=20, do_sample=False, stopping_criteria=criteria)
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        got = fast.generate(one, max_new_tokens=20, stopping_criteria=criteria, streamer=streamer)
        assert torch.equal(got, want)
        assert "".join(streamer) == tokenizer.decode(want[0, one.shape[1] :])


def test_criteria_complete_beams_as_transformers_does():
    model, _, fast, criteria, ids, mask = with_criteria()
    options = dict(
        attention_mask=mask, max_new_tokens=12, num_beams=3, num_return_sequences=2,
        do_sample=False, pad_token_id=0, stopping_criteria=criteria,
    )  # fmt: skip
    expected = model.generate(ids, **options)
    assert torch.equal(fast.generate(ids, **options), expected)
    plain = model.generate(ids, **{k: v for k, v in options.items() if k != "stopping_criteria"})
    assert not torch.equal(plain, expected)  # the criteria do end beams


def test_max_time_ends_every_row():
    model, tokenizer = model_and_tokenizer()
    fast = specdec.wrap(model, tokenizer)
    ids, mask = left_padded(tokenizer, TEXTS)
    options = dict(attention_mask=mask, max_new_tokens=20, do_sample=False)
    full = fast.generate(ids, **options)
    # no time at all: each row ends after its first token, as in transformers
    expected = model.generate(ids, max_time=0.0, **options)
    assert expected.shape[1] == ids.shape[1] + 1
    assert torch.equal(fast.generate(ids, max_time=0.0, **options), expected)
    assert torch.equal(fast.generate(ids, max_time=600.0, **options), full)
