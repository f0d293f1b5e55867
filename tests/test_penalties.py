"""Repetition, presence and frequency penalties: transformers' and OpenAI's rules, the same
output with a drafter as without (verification row j penalises with the first j drafts)."""

import pytest
import torch

from specdec import SamplingParams, SpecConfig
from specdec.drafters import DrafterBase
from specdec.sequence import Sequence
from specdec.verifier import Verifier

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)) * 2, [7] * 13, [200]]
PENALTIES = [
    {"repetition_penalty": 1.3},
    {"presence_penalty": 0.8, "frequency_penalty": 0.5},
    {"repetition_penalty": 0.8, "presence_penalty": -0.5, "frequency_penalty": 1.5},
]


def reference_greedy(model, prompt: list[int], n: int, presence: float, frequency: float):
    """Plain greedy decoding on transformers' logits with OpenAI's rule written out."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        for token in set(ids[len(prompt) :]):
            count = ids[len(prompt) :].count(token)
            logits[token] -= frequency * count + presence
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_repetition_penalty_is_transformers_rule(make_llm):
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3)
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        hf = llm.hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
            repetition_penalty=1.3, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
        assert out.token_ids == hf[0, len(prompt) :].tolist()
    assert [o.token_ids for o in plain] != [o.token_ids for o in llm.generate(PROMPTS, params)]


@torch.no_grad()
def test_presence_and_frequency_penalties_follow_openais_rule(make_llm):
    llm = make_llm()
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.5
    )
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert out.token_ids == reference_greedy(llm.hf_model, prompt, 20, 0.8, 0.5)


class OracleDrafter(DrafterBase):
    """Drafts the reference continuation itself: every draft is accepted, so each verification
    row's token must come out right with the drafts before it counted as generated tokens."""

    name = "oracle"

    def __init__(self, reference: dict[tuple[int, ...], list[int]]):
        self.reference = reference

    def propose(self, seqs: list[Sequence], num_drafts: list[int], step=None) -> None:
        for seq, k in zip(seqs, num_drafts):
            future = self.reference[tuple(seq.prompt_token_ids)][seq.num_output_tokens :]
            seq.spec_token_ids = future[:k]


@pytest.mark.parametrize("penalties", PENALTIES)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_speculation_keeps_penalised_output(make_llm, penalties, temperature):
    params = [
        SamplingParams(temperature=temperature, seed=s, max_tokens=30, ignore_eos=True, **penalties)
        for s in range(len(PROMPTS))
    ]
    plain = make_llm(block_size=4).generate(PROMPTS, params)
    reference = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    oracle = make_llm(speculative=SpecConfig(OracleDrafter(reference), 6, adaptive=False))
    lookup = make_llm(
        speculative={"drafter": "prompt_lookup", "num_speculative_tokens": 5, "adaptive": False},
        block_size=4,
    )
    for llm in (oracle, lookup):
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == list(reference.values())
    stats = oracle.engine.verifier.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_the_one_launch_verifier_penalises_as_the_walk(make_llm):
    """The Triton verification kernel (under the interpreter here) reads the same penalised
    rows: greedy and sampled requests mixed, each with other penalties."""
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=16, ignore_eos=True, **penalties)
        for i, (t, penalties) in enumerate(zip((0.0, 0.9, 0.0, 1.2), [*PENALTIES, {}]))
    ]
    plain = make_llm(block_size=4).generate(PROMPTS, params)
    reference = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    llm = make_llm(speculative=SpecConfig(OracleDrafter(reference), 5, adaptive=False))
    llm.engine.verifier = Verifier("triton")
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == list(reference.values())
    assert llm.engine.verifier.stats.num_accepted_tokens > 0


@pytest.mark.parametrize(
    "field, bad",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("presence_penalty", True),
        ("repetition_penalty", 0),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", "1.2"),
    ],
)
def test_bad_penalties_are_refused(field, bad):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: bad})


def test_logit_bias_forces_and_bans_tokens_the_same_with_a_drafter(make_llm):
    plain = make_llm()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = plain.generate(PROMPTS[2], greedy)[0].token_ids
    forced = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={42: 100})
    assert plain.generate(PROMPTS[2], forced)[0].token_ids == [42] * 12
    banned = {t: -100 for t in set(first)}
    params = [
        SamplingParams(temperature=t, seed=1, max_tokens=20, ignore_eos=True, logit_bias=banned)
        for t in (0.0, 1.0)
    ]
    out = plain.generate([PROMPTS[2]] * 2, params)
    assert all(not set(o.token_ids) & set(first) for o in out)
    lookup = make_llm(
        speculative={"drafter": "prompt_lookup", "num_speculative_tokens": 5, "adaptive": False}
    )
    assert [o.token_ids for o in lookup.generate([PROMPTS[2]] * 2, params)] == [
        o.token_ids for o in out
    ]


@pytest.mark.parametrize("field", ["stop_token_ids", "logit_bias"])
def test_token_ids_beyond_the_vocabulary_are_refused_before_any_step(make_llm, field):
    """A stop id past the vocabulary once reached the logits (with min_tokens) as an IndexError
    inside a step, which in the server ended the engine thread."""
    llm = make_llm()
    value = [300] if field == "stop_token_ids" else {300: 1.0}
    params = SamplingParams(max_tokens=4, min_tokens=2, **{field: value})
    with pytest.raises(ValueError, match=rf"{field} token ids must lie in \[0, 300\)"):
        llm.generate([1, 2, 3], params)
    assert llm.generate([1, 2, 3], SamplingParams(max_tokens=2))[0].token_ids  # still serving


@pytest.mark.parametrize("bad", [{-1: 1.0}, {5: 101}, {5: float("nan")}, {"5": 1.0}, [5]])
def test_bad_logit_bias_is_refused(bad):
    with pytest.raises(ValueError, match="logit_bias must map non-negative token ids"):
        SamplingParams(logit_bias=bad)
