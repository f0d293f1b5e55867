"""``specdec.wrap(model).generate(num_beams=...)``: transformers' beam search on the engine, the
same sequences, scores and beam indices, with its processors and stopping rules."""

from __future__ import annotations

import pytest
import torch
from transformers import TextStreamer

import specdec
from tests.test_wrap import TEXTS, left_padded, model_and_tokenizer

EOS_LISTS = [282, [64, 282, 248]]  # ids that end some of these beams early (found by search)


def assert_same_beams(expected, got) -> None:  # noqa: ANN001
    assert torch.equal(got.sequences, expected.sequences)
    assert torch.equal(got.beam_indices, expected.beam_indices)
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, atol=1e-4, rtol=0)
    assert len(got.scores) == len(expected.scores)  # one per step, until the whole batch ends
    for ours, theirs in zip(got.scores, expected.scores):
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))  # the same tokens banned
        torch.testing.assert_close(
            ours.nan_to_num(0, 0, 0), theirs.nan_to_num(0, 0, 0), atol=1e-4, rtol=0
        )
    assert (got.logits is None) == (expected.logits is None)
    for ours, theirs in zip(got.logits or (), expected.logits or ()):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("eos", EOS_LISTS)
@pytest.mark.parametrize(
    "early_stopping, length_penalty",
    [(False, 1.0), (True, 2.0), ("never", 0.0), ("never", 2.0), (False, -1.0)],
)
def test_beams_equal_transformers(eos, early_stopping, length_penalty):
    model, tokenizer = model_and_tokenizer()
    fast = specdec.wrap(model, tokenizer)
    ids, mask = left_padded(tokenizer, TEXTS)
    options = dict(
        attention_mask=mask, max_new_tokens=10, num_beams=3, num_return_sequences=2,
        do_sample=False, early_stopping=early_stopping, length_penalty=length_penalty,
        eos_token_id=eos, pad_token_id=0,
    )  # fmt: skip
    recorded = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected = model.generate(ids, **options, **recorded)
    assert_same_beams(expected, fast.generate(ids, **options, **recorded))
    # without the per-step rows, a prompt whose search has stopped runs no more steps
    assert torch.equal(fast.generate(ids, **options), expected.sequences)


# rows that end early (single prompts: the search stops before max_new_tokens), each with one
# of the processors transformers applies to the log-probabilities of every beam
PROCESSORS = [
    {},
    {"no_repeat_ngram_size": 2},
    {"min_new_tokens": 4},
    {"repetition_penalty": 1.5},
    {"bad_words_ids": [[282], [64, 91]]},
    {"sequence_bias": {(282,): -2.0, (91,): 1.5}},
    {"forced_eos_token_id": 248},
    {"begin_suppress_tokens": [282, 64], "suppress_tokens": [82]},
    {"exponential_decay_length_penalty": (2, 1.5)},
]


@pytest.mark.parametrize("processors", PROCESSORS, ids=lambda p: "+".join(p) or "none")
@pytest.mark.parametrize("early_stopping", [False, True])
def test_processors_and_early_endings_equal_transformers(processors, early_stopping):
    model, tokenizer = model_and_tokenizer()
    fast = specdec.wrap(model, tokenizer)
    lengths = set()
    for text in ("a", "the quick brown fox jumps over"):
        ids = torch.tensor([tokenizer.encode(text)])
        options = dict(
            max_new_tokens=12, num_beams=4, num_return_sequences=2, do_sample=False,
            early_stopping=early_stopping, eos_token_id=[64, 282, 248], pad_token_id=0,
            return_dict_in_generate=True, output_scores=True, **processors,
        )  # fmt: skip
        expected = model.generate(ids, **options)
        assert_same_beams(expected, fast.generate(ids, **options))
        lengths.add(len(expected.scores))
    assert min(lengths) < 12 or processors  # the plain case does end before max_new_tokens


def test_without_return_dict_the_output_is_the_sequences():
    model, tokenizer = model_and_tokenizer()
    fast = specdec.wrap(model, tokenizer)
    ids = torch.tensor([tokenizer.encode("hello world")])
    expected = model.generate(ids, max_new_tokens=8, num_beams=2, do_sample=False)
    assert torch.equal(fast.generate(ids, max_new_tokens=8, num_beams=2), expected)


WARPERS = [
    {},
    {"top_k": 20, "temperature": 0.7},
    {"top_p": 0.8},  # cuts that keep fewer tokens than there are EOS ids + 1 keep that many
    {"no_repeat_ngram_size": 2, "temperature": 1.3},
    {"min_p": 0.05, "renormalize_logits": True},
    {"typical_p": 0.9, "epsilon_cutoff": 1e-3},
    {"eta_cutoff": 1e-3, "top_k": 0},
]


@pytest.mark.parametrize("warpers", WARPERS, ids=lambda p: "+".join(p) or "none")
@pytest.mark.parametrize("batch", [1, 4])
def test_beam_sampling_draws_what_transformers_draws(warpers, batch):
    # the same candidates drawn from torch's global generator: the same sequences for a seed
    model, tokenizer = model_and_tokenizer()
    fast = specdec.wrap(model, tokenizer)
    ids, mask = left_padded(tokenizer, TEXTS[:batch])
    options = dict(
        attention_mask=mask, max_new_tokens=10, num_beams=3, num_return_sequences=2,
        do_sample=True, eos_token_id=[64, 282, 248], pad_token_id=0,
        return_dict_in_generate=True, output_scores=batch == 1, **warpers,
    )  # fmt: skip
    outputs = set()
    for seed in range(3):
        torch.manual_seed(seed)
        expected = model.generate(ids, **options)
        torch.manual_seed(seed)
        got = fast.generate(ids, **options)
        if batch == 1:
            assert_same_beams(expected, got)
        else:  # a prompt's search that stops early still draws at every step
            assert torch.equal(got.sequences, expected.sequences)
        outputs.add(tuple(expected.sequences.flatten().tolist()))
    assert len(outputs) > 1  # the seeds do draw different beams


def test_renormalized_scores_equal_transformers():
    model, tokenizer = model_and_tokenizer()
    fast = specdec.wrap(model, tokenizer)
    ids = torch.tensor([tokenizer.encode("the quick brown fox")])
    options = dict(
        max_new_tokens=6, no_repeat_ngram_size=1, renormalize_logits=True,
        return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    expected = model.generate(ids, do_sample=False, **options)
    got = fast.generate(ids, do_sample=False, **options)
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs in zip(got.scores, expected.scores):  # log-probabilities, bans at -inf
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        torch.testing.assert_close(
            ours.nan_to_num(0, 0, 0), theirs.nan_to_num(0, 0, 0), atol=1e-4, rtol=0
        )
    beams = dict(num_beams=3, do_sample=False, eos_token_id=[64, 282, 248], pad_token_id=0)
    assert_same_beams(
        model.generate(ids, **options, **beams), fast.generate(ids, **options, **beams)
    )


def test_beam_arguments_are_refused():
    model, tokenizer = model_and_tokenizer()
    fast = specdec.wrap(model, tokenizer)
    ids = torch.tensor([tokenizer.encode("hi")])
    with pytest.raises(ValueError, match="has to be smaller or equal to `num_beams`"):
        fast.generate(ids, num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="early_stopping"):
        fast.generate(ids, num_beams=2, early_stopping="soon")
    with pytest.raises(ValueError, match="streamer"):
        fast.generate(ids, num_beams=2, streamer=TextStreamer(tokenizer))
    with pytest.raises(ValueError, match="needs num_beams=1"):
        fast.generate(ids, num_beams=2, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="needs num_beams=1"):
        fast.generate(ids, num_beams=2, assistant_model=model)


def test_early_stopping_never_scores_live_beams_at_max_length():
    # a prompt and EOS id where transformers' "never" runs longer than False (found by search)
    model, tokenizer = model_and_tokenizer()
    fast = specdec.wrap(model, tokenizer)
    ids = torch.tensor([tokenizer.encode("a")])
    steps = {}
    for early_stopping in (False, "never"):
        options = dict(
            max_new_tokens=8, num_beams=4, num_return_sequences=2, do_sample=False,
            early_stopping=early_stopping, length_penalty=1.0, eos_token_id=282, pad_token_id=0,
            return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip
        expected = model.generate(ids, **options)
        assert_same_beams(expected, fast.generate(ids, **options))
        steps[early_stopping] = len(expected.scores)
    assert steps[False] < steps["never"]


def test_many_end_of_sequence_ids_widen_the_candidates():
    # the first step's 2nd to 6th most likely tokens end a beam: transformers keeps (1 + 5) * width
    # candidates a step, so that `width` beams still go on
    model, tokenizer = model_and_tokenizer()
    fast = specdec.wrap(model, tokenizer)
    ids = torch.tensor([tokenizer.encode("hello world")])
    with torch.no_grad():
        eos = model(ids).logits[0, -1].topk(6).indices[1:].tolist()
    options = dict(
        max_new_tokens=6, num_beams=4, num_return_sequences=4, do_sample=False,
        eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    expected = model.generate(ids, **options)
    assert_same_beams(expected, fast.generate(ids, **options))


def test_stop_strings_complete_beams_as_transformers_does():
    model, tokenizer = model_and_tokenizer()
    fast = specdec.wrap(model, tokenizer)
    ids = torch.tensor([tokenizer.encode("the quick brown fox")])
    options = dict(
        max_new_tokens=10, num_beams=3, num_return_sequences=3, do_sample=False, pad_token_id=0
    )
    free = model.generate(ids, **options)
    text = tokenizer.decode(free[0, ids.shape[1] + 2 : ids.shape[1] + 4])  # met by the best beam
    stopped = dict(options, stop_strings=[text], tokenizer=tokenizer)
    expected = model.generate(ids, **stopped)
    assert not torch.equal(expected, free)
    assert torch.equal(fast.generate(ids, **stopped), expected)
