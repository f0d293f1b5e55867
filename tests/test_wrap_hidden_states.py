"""``specdec.wrap``'s ``output_hidden_states`` and ``output_attentions``: transformers' per-step,
per-layer tensors."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria

import specdec
from tests.test_wrap import TEXTS, left_padded, model_and_tokenizer
from tests.tiny import tiny_model

OUTPUTS = dict(return_dict_in_generate=True, output_hidden_states=True)


def assert_steps_match(actual, expected, mask: torch.Tensor, lengths: list[int]) -> None:  # noqa: ANN001
    """Equal shapes; close states at real positions (transformers also computes its padding's
    and its ended rows' pad tokens', which read zeros here)."""
    assert len(actual) == len(expected)
    for t, (ours, theirs) in enumerate(zip(actual, expected)):
        assert len(ours) == len(theirs)
        real = mask.bool() if t == 0 else torch.tensor([n > t for n in lengths])[:, None]
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape
            torch.testing.assert_close(a[real], b[real], atol=5e-5, rtol=1e-4)
            assert not a[~real].any()


def assert_attention_steps_match(actual, expected, mask, lengths: list[int]) -> None:  # noqa: ANN001
    """Equal shapes; close probabilities in the rows of real positions (at the first step, the
    prompt's rows; after, the rows that have not ended), zeros in the others."""
    assert len(actual) == len(expected)
    for t, (ours, theirs) in enumerate(zip(actual, expected)):
        if t == 0:
            real = mask.bool()[:, None, :, None].expand_as(ours[0])
        else:
            real = torch.tensor([n > t for n in lengths])[:, None, None, None].expand_as(ours[0])
        for a, b in zip(ours, theirs, strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=1e-4)
            assert not a[~real].any()


def new_lengths(sequences: torch.Tensor, width: int, pad: int) -> list[int]:
    """Each row's generated tokens (the EOS that ended it included), as ``generate`` pads."""
    return [
        next((i + 1 for i, t in enumerate(row[width:].tolist()) if t == pad), len(row) - width)
        for row in sequences
    ]


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_hidden_states_equal_transformers(batch):
    model, tokenizer = model_and_tokenizer()
    ids, mask = left_padded(tokenizer, TEXTS[:batch])
    eos = 179  # ends rows 0 and 3 early: transformers goes on feeding them pad tokens
    options = dict(attention_mask=mask, max_new_tokens=16, eos_token_id=eos, pad_token_id=eos)
    expected = model.generate(ids, do_sample=False, **options, **OUTPUTS)
    fast = specdec.wrap(model, tokenizer)
    lengths = new_lengths(expected.sequences, ids.shape[1], eos)
    assert min(lengths) < 16
    for drafting in ({}, {"prompt_lookup_num_tokens": 3}, {"assistant_model": tiny_model(seed=1)}):
        out = fast.generate(ids, **options, **OUTPUTS, **drafting)
        assert torch.equal(out.sequences, expected.sequences)
        assert_steps_match(out.hidden_states, expected.hidden_states, mask, lengths)


def test_greedy_attentions_equal_transformers():
    model, tokenizer = model_and_tokenizer()
    model.config._attn_implementation = "eager"  # transformers' implementation that returns them
    ids, mask = left_padded(tokenizer, TEXTS)
    eos = 179  # ends rows 0 and 3 early
    options = dict(attention_mask=mask, max_new_tokens=16, eos_token_id=eos, pad_token_id=eos)
    outputs = dict(return_dict_in_generate=True, output_attentions=True)
    expected = model.generate(ids, do_sample=False, **options, **outputs)
    lengths = new_lengths(expected.sequences, ids.shape[1], eos)
    fast = specdec.wrap(model, tokenizer)
    for drafting in ({}, {"prompt_lookup_num_tokens": 3}):
        out = fast.generate(ids, **options, **outputs, **drafting)
        assert torch.equal(out.sequences, expected.sequences) and out.hidden_states is None
        assert_attention_steps_match(out.attentions, expected.attentions, mask, lengths)


def test_sampled_rows_have_the_states_of_their_own_tokens():
    """Sampled tokens differ from transformers' (another generator), so each row's states are
    checked against a forward over its own sequence; num_return_sequences repeats the prompts."""
    model, tokenizer = model_and_tokenizer()
    ids, mask = left_padded(tokenizer, TEXTS[:2])
    fast = specdec.wrap(model, tokenizer)
    out = fast.generate(
        ids, attention_mask=mask, max_new_tokens=10, do_sample=True, num_return_sequences=2,
        **OUTPUTS,
    )  # fmt: skip
    assert len(out.hidden_states[0][0]) == 4
    for b, row in enumerate(out.sequences):
        prompt = ids[b // 2][mask[b // 2].bool()].tolist()
        width = ids.shape[1]
        steps = new_lengths(out.sequences[b : b + 1], width, tokenizer.eos_token_id)[0]
        fed = prompt + row[width : width + steps - 1].tolist()
        with torch.no_grad():
            reference = model(torch.tensor([fed]), output_hidden_states=True).hidden_states
        real = mask[b // 2].bool()
        for layer, expected in enumerate(reference):
            ours = torch.cat(
                [out.hidden_states[0][layer][b][real]]
                + [out.hidden_states[t][layer][b] for t in range(1, steps)]
            )
            torch.testing.assert_close(ours, expected[0], atol=5e-5, rtol=1e-4)


class AfterTokens(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):  # noqa: ANN001, ANN003, ANN204
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length)


def test_a_stopping_criterion_ends_the_steps_with_the_tokens():
    model, tokenizer = model_and_tokenizer()
    ids, mask = left_padded(tokenizer, TEXTS[1:2])
    options = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, **OUTPUTS)
    criteria = [AfterTokens(ids.shape[1] + 5)]
    expected = model.generate(ids, stopping_criteria=criteria, **options)
    out = specdec.wrap(model, tokenizer).generate(ids, stopping_criteria=criteria, **options)
    assert torch.equal(out.sequences, expected.sequences) and len(out.hidden_states) == 5
    assert_steps_match(out.hidden_states, expected.hidden_states, mask, [5])


@pytest.mark.parametrize("name", ["output_hidden_states", "output_attentions"])
def test_beam_search_with_layer_outputs_is_refused(name):
    model, tokenizer = model_and_tokenizer()
    ids, _ = left_padded(tokenizer, TEXTS[:1])
    with pytest.raises(ValueError, match=f"{name} with num_beams > 1 is not supported"):
        specdec.wrap(model, tokenizer).generate(
            ids, num_beams=2, return_dict_in_generate=True, **{name: True}
        )
