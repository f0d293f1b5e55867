"""``SamplingParams.guide_after`` (:mod:`specdec.structured.after`): the output is free until a
text first appears, then follows the guide, as vLLM guides a reasoning model only after its
``</think>``. The DFA against a reference written with ``str.find`` and ``re``; the engine's
greedy output against the masked argmax of transformers' logits; any drafter keeps the output."""

import random
import re

import pytest
import torch

from specdec import SamplingParams, SpecConfig
from specdec.structured.after import after_text
from specdec.structured.guide import token_bytes
from specdec.structured.regex import compile_regex
from tests.test_penalties import OracleDrafter
from tests.test_structured import PROMPTS, outputs


@pytest.mark.parametrize(
    ("after", "inner"),
    [("</think>", r"[0-9]{1,3}"), ("aab", r"b*"), ("abab", r"(ab)?c"), ("<", r"x|<y")],
)
def test_the_dfa_is_free_until_the_text_then_the_pattern(after, inner):
    rng = random.Random(after)
    alphabet = sorted(set(after + "0123abcxy<>/t["))

    def free_then_guided(text: str) -> bool:
        found = text.find(after)
        return found < 0 or re.fullmatch(inner, text[found + len(after) :]) is not None

    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(12))) for _ in range(4000)]
    texts += [after + "12", "x" + after, after * 2, ""]
    texts += [after[:k] + after + tail for k in range(len(after)) for tail in ("", "7", "b")]
    dfa, free = after_text(after.encode(), compile_regex(inner))
    for text in texts:
        assert dfa.fullmatch(text) == free_then_guided(text), text
    # entered through an opening, or guided from the first byte: the union of the two
    dfa, free = after_text(after.encode(), compile_regex(inner), b"[")
    for text in [*texts, *("[" + t for t in texts)]:
        opened = text.startswith("[") and free_then_guided(text[1:])
        assert dfa.fullmatch(text) == (opened or re.fullmatch(inner, text) is not None), text
    assert free[dfa.walk(dfa.start, b"[")] and not free[dfa.start]


def first_text(llm, prompt: list[int]) -> tuple[int, str] | None:  # noqa: ANN001
    """The first text of the prompt's greedy reply that its bytes spell whole (UTF-8), and the
    position of its last token: the reply's first bytes that decode, so it occurs nowhere
    before (None if no bytes of it decode)."""
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].token_ids
    spelled = token_bytes(llm.tokenizer, llm.engine.vocab_size)
    for start in range(len(plain)):
        for end in range(start + 1, min(start + 8, len(plain)) + 1):
            data = b"".join(spelled[t] for t in plain[start:end])
            try:
                if data and spelled[plain[start]]:
                    return end - 1, data.decode("utf-8")
            except UnicodeDecodeError:
                continue
    return None


def masked_greedy(llm, prompt: list[int], params: SamplingParams) -> list[int]:  # noqa: ANN001
    """transformers' argmax over the tokens the request's guide allows, step by step."""
    guide, eos = llm.engine.guides.for_params(params), llm.engine.eos_token_ids
    ids, state = [], guide.start()
    with torch.no_grad():
        while len(ids) < params.max_tokens:
            logits = llm.hf_model(torch.tensor([prompt + ids])).logits[0, -1]
            token = int(logits.masked_fill(~guide.allowed(state), float("-inf")).argmax())
            ids.append(token)
            if token in eos:
                break
            state = guide.advance(state, token)
    return ids


def test_greedy_is_free_until_the_text_then_guided(make_llm):
    llm = make_llm()
    eos = llm.engine.eos_token_ids
    found = [(prompt, first_text(llm, prompt)) for prompt in PROMPTS]
    cases = [(prompt, *text) for prompt, text in found if text is not None]
    assert len(cases) >= 3
    for prompt, position, after in cases:
        params = SamplingParams(temperature=0, max_tokens=40, regex="[0-9]{3}", guide_after=after)
        ids = masked_greedy(llm, prompt, params)
        out = llm.generate([prompt], params)[0]
        assert out.token_ids == ids
        plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
        assert out.token_ids[: position + 1] == plain.token_ids[: position + 1]  # free until it
        assert ids[-1] in eos and re.fullmatch("[0-9]{3}", llm.decode(ids[position + 1 : -1]))


def test_an_opening_enters_the_free_part_and_otherwise_the_guide_starts(make_llm):
    """guide_after_opening: the union of "opening, free until the text, guided" and "guided";
    greedy follows the masked argmax, either way."""
    llm, branches = make_llm(), set()
    for prompt in PROMPTS:
        for opening in ("<think>", "\x07"):
            params = SamplingParams(temperature=0, max_tokens=30, regex="[0-9]{3}",
                                    guide_after="</think>", guide_after_opening=opening)  # fmt: skip
            out = llm.generate([prompt], params)[0]
            assert out.token_ids == masked_greedy(llm, prompt, params)
            ids = out.token_ids
            text = llm.decode(ids[:-1] if ids[-1] in llm.engine.eos_token_ids else ids)
            branches.add(text.startswith(opening))
            assert text.startswith(opening) or re.fullmatch("[0-9]{0,3}", text), text
    assert branches == {False, True}  # both ways were taken


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_keeps_the_output(make_llm, temperature):
    probe = make_llm()
    found = [(prompt, first_text(probe, prompt)) for prompt in PROMPTS]
    prompts = [prompt for prompt, text in found if text is not None]
    params = [
        SamplingParams(temperature=temperature, seed=s, max_tokens=24, guide_after=text[1],
                       guide_after_opening="\x07" if s % 2 == 0 else None,
                       **[{"choice": ["yes", "no"]}, {"regex": "[0-9]{2}x"},
                          {"grammar": 'root ::= "(" root ")" | "x"'}][s % 3])
        for s, (_, text) in enumerate(t for t in found if t[1] is not None)
    ]  # fmt: skip
    plain = outputs(make_llm(), prompts, params)
    reference = {tuple(p): o for p, o in zip(prompts, plain)}
    oracle = make_llm(speculative=SpecConfig(OracleDrafter(reference), 4, adaptive=False))
    lookup = make_llm(speculative=SpecConfig("prompt_lookup", 4, adaptive=False))
    for llm in (oracle, lookup):
        assert outputs(llm, prompts, params) == plain
    stats = oracle.engine.verifier.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"guide_after": "</think>"}, "and no guide"),
        ({"guide_after": "", "regex": "a"}, "guide_after must be a non-empty string"),
        ({"guide_after": 3, "regex": "a"}, "guide_after must be a non-empty string"),
        ({"guide_after_opening": "<think>", "regex": "a"}, "with guide_after"),
    ],
)
def test_bad_guide_after_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)
