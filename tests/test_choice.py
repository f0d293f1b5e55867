"""Guided choice: the output is one of the given strings, decided from the model's own logits
over the tokens that continue a choice, the same with a drafter as without."""

import math
import random

import pytest
import torch
from scipy.stats import chisquare

from specdec import SamplingParams, SpecConfig
from specdec.sequence import Sequence
from specdec.structured.guide import END, ChoiceGuide
from specdec.verifier import Verifier
from tests.test_penalties import OracleDrafter

CHOICES = ["yes", "no", "maybe", "yesterday", "é€"]
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)) * 2, [7] * 13, [200]]


def spelled(llm, text: str) -> list[int]:  # noqa: ANN001
    return llm.tokenizer.encode(text, add_special_tokens=False)


def chosen(llm, out) -> str:  # noqa: ANN001
    """The choice an output made: its text before the end-of-sequence token that ended it (the
    tiny model's config names a byte token, 2, as one of its end-of-sequence ids)."""
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    return llm.decode(out.token_ids[:-1])


def candidates(llm, output: list[int]) -> list[int]:  # noqa: ANN001
    """The tokens that may follow ``output``: the next token of every choice it begins, and
    the end-of-sequence ids where it is a whole choice."""
    tokens: set[int] = set()
    for ids in (spelled(llm, c) for c in CHOICES):
        if ids[: len(output)] == output:
            tokens |= (
                {ids[len(output)]} if len(ids) > len(output) else set(llm.engine.eos_token_ids)
            )
    return sorted(tokens)


@torch.no_grad()
def choice_probabilities(llm, prompt: list[int]) -> dict[str, float]:  # noqa: ANN001
    """Each choice's probability when every step samples from the model's distribution
    renormalised over :func:`candidates`."""
    eos = set(llm.engine.eos_token_ids)
    result = {}
    for text in CHOICES:
        ids, probability = spelled(llm, text), 1.0
        for i in range(len(ids) + 1):
            logits = llm.hf_model(torch.tensor([prompt + ids[:i]])).logits[0, -1].double()
            allowed = candidates(llm, ids[:i])
            p = dict(zip(allowed, torch.softmax(logits[allowed], dim=0).tolist()))
            probability *= p[ids[i]] if i < len(ids) else sum(p[t] for t in eos)
        result[text] = probability
    return result


def test_greedy_takes_the_most_likely_continuation_of_a_choice(make_llm):
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=10, choice=CHOICES)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert chosen(llm, out) in CHOICES
        # step by step: the argmax over the tokens that continue some choice
        ids, eos = [], llm.engine.eos_token_ids
        with torch.no_grad():
            while True:
                logits = llm.hf_model(torch.tensor([prompt + ids])).logits[0, -1]
                token = max(candidates(llm, ids), key=lambda t: logits[t].item())
                if token in eos:
                    break
                ids.append(token)
        assert out.token_ids[:-1] == ids and out.token_ids[-1] in eos


def test_sampling_follows_the_models_law_over_the_choices(make_llm):
    """Chi-square over 600 seeded draws at temperature 1 against the probabilities written out
    from transformers' logits."""
    llm = make_llm()
    prompt = PROMPTS[1]
    expected = choice_probabilities(llm, prompt)
    assert math.isclose(sum(expected.values()), 1.0, rel_tol=1e-6)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=10, choice=CHOICES) for s in range(600)
    ]
    counts = {c: 0 for c in CHOICES}
    for out in llm.generate([prompt] * 600, params):
        counts[chosen(llm, out)] += 1
    seen = [c for c in CHOICES if expected[c] * 600 >= 5]  # pool the rare ones
    observed = [counts[c] for c in seen] + [600 - sum(counts[c] for c in seen)]
    wanted = [expected[c] * 600 for c in seen] + [600 * (1 - sum(expected[c] for c in seen))]
    if wanted[-1] < 1e-9:
        observed, wanted = observed[:-1], wanted[:-1]
    assert chisquare(observed, wanted).pvalue > 1e-3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_keeps_the_constrained_output(make_llm, temperature):
    """Every draft accepted (an oracle), drafts mostly rejected (prompt lookup), and the Triton
    verifier under the interpreter: the output is plain decoding's."""
    params = [
        SamplingParams(temperature=temperature, seed=s, max_tokens=10, choice=CHOICES)
        for s in range(len(PROMPTS))
    ]
    plain = make_llm().generate(PROMPTS, params)
    reference = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    oracle = make_llm(speculative=SpecConfig(OracleDrafter(reference), 4, adaptive=False))
    lookup = make_llm(
        speculative={"drafter": "prompt_lookup", "num_speculative_tokens": 4, "adaptive": False}
    )
    triton = make_llm(speculative=SpecConfig(OracleDrafter(reference), 4, adaptive=False))
    triton.engine.verifier = Verifier("triton")
    for llm in (oracle, lookup, triton):
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == list(reference.values())
    stats = oracle.engine.verifier.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_allowed_tokens_walk_the_choices(make_llm):
    llm = make_llm()
    seq = Sequence(0, [5], 1, SamplingParams(choice=["ab", "abc"]), eos_token_ids=(257,))
    seq.guide = guide = ChoiceGuide(["ab", "abc"], llm.tokenizer, (257,))
    a, b, c = spelled(llm, "abc")
    assert seq.allowed_tokens(0) == [a]
    seq.token_ids.append(a)
    seq.spec_token_ids = [b, c, 9]
    assert seq.allowed_tokens(0) == [b]
    assert seq.allowed_tokens(1) == [c, 257]  # "ab" is complete: it may end, or go on to "abc"
    assert seq.allowed_tokens(2) == [257]
    assert seq.allowed_tokens(3) is None  # past a draft no choice has: a row never used
    assert END in guide.trie[a][b]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", ""]}, "choice must be a non-empty list of non-empty strings"),
        ({"choice": "yes"}, "choice must be a non-empty list"),
        ({"choice": ["a"], "ignore_eos": True}, "leave ignore_eos and min_tokens unset"),
        ({"choice": ["a"], "min_tokens": 2}, "leave ignore_eos and min_tokens unset"),
    ],
)
def test_bad_choices_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_a_random_mix_of_choice_and_free_requests_in_one_batch(make_llm):
    llm = make_llm(speculative={"drafter": "prompt_lookup", "num_speculative_tokens": 3})
    rng = random.Random(0)
    params = [
        SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=i, max_tokens=12,
                       choice=CHOICES if i % 2 else None)
        for i in range(8)
    ]  # fmt: skip
    outputs = llm.generate([PROMPTS[i % 4] for i in range(8)], params)
    plain = make_llm().generate([PROMPTS[i % 4] for i in range(8)], params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert all(chosen(llm, o) in CHOICES for o in outputs[1::2])
