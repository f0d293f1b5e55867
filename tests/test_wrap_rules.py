"""``specdec.wrap`` with transformers' logits processors and warpers (repetition penalty, token
rules, sequence bias, forcing rules, length decay, typical, epsilon and eta sampling): outputs
and scores equal transformers', with drafts too."""

from __future__ import annotations

import pytest
import torch
import transformers

import specdec
from tests.test_wrap import TEXTS, model_and_tokenizer


def assert_greedy_equals(fast, ids: torch.Tensor, kwargs: dict, expected) -> None:  # noqa: ANN001
    """Greedy sequences and scores equal transformers' ``expected``, plain and with drafts."""
    for extra in ({}, {"prompt_lookup_num_tokens": 3}):
        out = fast.generate(ids, do_sample=False, **kwargs, **extra)
        assert torch.equal(out.sequences, expected.sequences)
        for ours, theirs in zip(out.scores, expected.scores):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_repetition_penalty_equals_transformers():
    """Greedy and seeded-sampled output, and the scores of both, under transformers' rule; with a
    drafter too."""
    model, tokenizer = model_and_tokenizer()
    ids = torch.tensor([tokenizer.encode(TEXTS[1]) * 2])  # repeats: the penalty has work to do
    kwargs = dict(max_new_tokens=16, repetition_penalty=1.8, return_dict_in_generate=True,
                  output_scores=True)  # fmt: skip
    expected = model.generate(ids, do_sample=False, **kwargs)
    unpenalised = model.generate(ids, do_sample=False, max_new_tokens=16)
    assert not torch.equal(expected.sequences, unpenalised)  # the penalty changes the output
    fast = specdec.wrap(model, tokenizer)
    assert_greedy_equals(fast, ids, kwargs, expected)
    # sampled: each step's scores are the log-probabilities of the penalised logits
    sampled = fast.generate(ids, do_sample=True, top_k=0, **kwargs)
    penalty = transformers.RepetitionPenaltyLogitsProcessor(1.8)
    with torch.no_grad():
        logits = model(sampled.sequences).logits[0]
    for t, ours in enumerate(sampled.scores):
        prefix = sampled.sequences[:, : ids.shape[1] + t]
        theirs = penalty(prefix, logits[None, prefix.shape[1] - 1].clone()).log_softmax(-1)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def token_rules(case: str, free: torch.Tensor, prompt_len: int) -> dict:
    """The rules of ``case``, its token ids taken from the unconstrained output ``free``."""
    new = free[:, prompt_len:].tolist()
    if case == "ngram-2":
        return {"no_repeat_ngram_size": 2}
    if case == "ngram-3-suppress":
        return {"no_repeat_ngram_size": 3, "suppress_tokens": [new[0][3], new[1][5]]}
    if case == "sequence-bias-begin":  # transformers' list form; a prefix ending the prompt
        bias = [
            [[new[0][2]], -3.0],
            [new[1][3:5], -20.0],
            [[int(free[0, prompt_len - 1]), new[0][0]], -9.0],
        ]
        return {"sequence_bias": bias, "begin_suppress_tokens": [new[1][0]]}
    return {"bad_words_ids": [new[0][2:4], [new[1][1]], new[1][4:7]]}  # words the output holds


@pytest.mark.parametrize(
    "case", ["ngram-2", "ngram-3-suppress", "bad-words", "sequence-bias-begin"]
)
def test_token_rules_equal_transformers(case):
    """``no_repeat_ngram_size``, ``suppress_tokens``, ``bad_words_ids`` and ``sequence_bias``
    (over the prompt and the output, as transformers' processors read ``input_ids``) and
    ``begin_suppress_tokens``: greedy output and scores equal transformers', with a drafter
    too."""
    model, tokenizer = model_and_tokenizer()
    ids = torch.tensor(
        [tokenizer.encode(t) for t in ("the fox and the dog", "abcde abcde abcd ab")]
    )
    free = model.generate(ids, do_sample=False, max_new_tokens=24)
    rules = token_rules(case, free, ids.shape[1])
    kwargs = dict(max_new_tokens=24, return_dict_in_generate=True, output_scores=True, **rules)
    expected = model.generate(ids, do_sample=False, **kwargs)
    assert not torch.equal(expected.sequences, free)  # the rules change the output
    fast = specdec.wrap(model, tokenizer)
    assert_greedy_equals(fast, ids, kwargs, expected)


def test_typical_epsilon_and_eta_sampling_scores_equal_transformers():
    """Sampled with transformers' typical, epsilon and eta warpers: each step's scores are the
    log-probabilities of the warped distribution, and the sampled tokens lie within it."""
    model, tokenizer = model_and_tokenizer()
    ids = torch.tensor([tokenizer.encode(TEXTS[1])])
    kwargs = dict(max_new_tokens=12, return_dict_in_generate=True, output_scores=True, top_k=0,
                  typical_p=0.8, epsilon_cutoff=0.001, eta_cutoff=0.005)  # fmt: skip
    torch.manual_seed(0)
    sampled = specdec.wrap(model, tokenizer).generate(ids, do_sample=True, **kwargs)
    warpers = [
        transformers.TypicalLogitsWarper(0.8),
        transformers.EpsilonLogitsWarper(0.001),
        transformers.EtaLogitsWarper(0.005),
    ]
    with torch.no_grad():
        logits = model(sampled.sequences).logits[0]
    for t, ours in enumerate(sampled.scores):
        theirs = logits[None, ids.shape[1] + t - 1].clone()
        for warper in warpers:
            theirs = warper(None, theirs)
        theirs = theirs.log_softmax(-1)
        assert torch.equal(ours.isfinite(), theirs.isfinite()), t
        assert ours.isinf().any()  # the warpers cut something
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        assert ours[0, sampled.sequences[0, ids.shape[1] + t]].isfinite()


@pytest.mark.parametrize("case", ["forced", "decay"])
def test_forcing_rules_and_length_decay_equal_transformers(case):
    """``forced_bos_token_id`` (one-token inputs), ``forced_eos_token_id`` and
    ``exponential_decay_length_penalty`` (an EOS id from the output, raised until it ends the
    rows): greedy output and scores equal transformers', with a drafter too."""
    model, tokenizer = model_and_tokenizer()
    if case == "forced":  # inputs of one token: transformers forces BOS only then
        ids = torch.tensor([tokenizer.encode("t"), tokenizer.encode("a")])
    else:
        ids = torch.tensor(
            [tokenizer.encode(t) for t in ("the fox and the dog", "abcde abcde abcd ab")]
        )
    base = dict(max_new_tokens=20)
    free = model.generate(ids, do_sample=False, **base)
    new = free[:, ids.shape[1] :].tolist()
    if case == "forced":
        rules: dict = {"forced_bos_token_id": new[0][2], "forced_eos_token_id": [new[1][4], 3]}
    else:
        base["eos_token_id"] = new[1][9]  # the unconstrained run ends here too: compare with it
        free = model.generate(ids, do_sample=False, **base)
        rules = {"exponential_decay_length_penalty": (2, 1.6)}
    kwargs = dict(return_dict_in_generate=True, output_scores=True, **base, **rules)
    expected = model.generate(ids, do_sample=False, **kwargs)
    assert not torch.equal(expected.sequences, free)  # the rules change the output
    fast = specdec.wrap(model, tokenizer)
    assert_greedy_equals(fast, ids, kwargs, expected)


@pytest.mark.parametrize("strings", [["s!"], ["dogI"], [",\x1c", "&;"]])
def test_stop_strings_equal_transformers(strings):
    """``stop_strings`` (with ``tokenizer=``, as transformers asks): each row ends with the token
    that completes one, one may begin in the prompt ("dog" + "I"), and the sequences equal
    transformers', with a drafter too."""
    model, tokenizer = model_and_tokenizer()
    ids = torch.tensor(
        [tokenizer.encode(t) for t in ("the fox and the dog", "abcde abcde abcd ab")]
    )
    kwargs = dict(max_new_tokens=24, stop_strings=strings, tokenizer=tokenizer)
    expected = model.generate(ids, do_sample=False, **kwargs)
    free = model.generate(ids, do_sample=False, max_new_tokens=24)
    assert not torch.equal(expected, free)  # a row stopped early
    fast = specdec.wrap(model, tokenizer)
    for extra in ({}, {"prompt_lookup_num_tokens": 3}):
        assert torch.equal(fast.generate(ids, do_sample=False, **kwargs, **extra), expected)
