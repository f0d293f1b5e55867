"""Repetitions with large counts kept as counters (specdec/structured/counted.py): the strings a
counted guide takes against Python's ``re`` (small counts, counted by lowering the threshold),
its masks against reading each token alone on SmolLM2's vocabulary, and what it lifts: JSON
strings of thousands of characters, compiled at once."""

import itertools
import json
import re
import time

import pytest
from transformers import AutoTokenizer

from specdec import SamplingParams
from specdec.loader import default_model_dir
from specdec.structured import counted as counted_module
from specdec.structured import pushdown
from specdec.structured.counted import counted
from specdec.structured.guide import GuideFactory
from specdec.structured.pushdown import PushdownGuide
from specdec.structured.regex import parse_regex
from tests.test_grammar import accepted

PATTERNS = [
    ("(a|bc){2,4}", "abc"),
    ("(a|bc){5,8}", "abc"),  # counts below 4 look alike, and so do 5 to 7 (one byte a token)
    ("(ab|a){2,5}b?", "ab"),  # where one reading ends and the next begins is ambiguous
    ("(a|b)*a(a|b){3}", "ab"),  # where the counted part begins is ambiguous
    ("((ab){2,3}c){2,3}", "abc"),  # a count within a count
    ("a{3,}b", "ab"),  # no most
    ("(a?b){2,6}", "ab"),  # an item that may be short
    ("x(a|b){0,5}y", "abxy"),
]


def counted_guide(llm, pattern):  # noqa: ANN001, ANN201
    guide = llm.engine.guides.for_params(SamplingParams(regex=pattern))
    assert isinstance(guide, PushdownGuide)
    assert any(dfa.counts is not None for dfa in guide.dfas)
    return guide


@pytest.mark.parametrize("pattern, alphabet", PATTERNS)
def test_a_counted_repetition_takes_exactly_its_strings(make_llm, monkeypatch, pattern, alphabet):
    """Every string of up to 10 characters (7 of 3 letters, 6 of 4), one token each (the byte
    tokenizer's, one byte long: counts from ``low`` to ``high - 1`` share their masks)."""
    monkeypatch.setattr(counted_module, "COUNT_FROM", 1)
    monkeypatch.setattr(counted_module, "MIN_COUNT", 2)
    llm = make_llm()
    guide = counted_guide(llm, pattern)
    longest = {2: 10, 3: 7, 4: 6}[len(alphabet)]
    for n in range(longest + 1):
        for letters in itertools.product(alphabet, repeat=n):
            text = "".join(letters)
            expected = re.fullmatch(pattern, text) is not None
            assert accepted(guide, llm.tokenizer, text) == expected, (pattern, text)


def test_repetitions_are_counted_by_their_unrolled_size():
    def rules(pattern: str) -> list[tuple]:
        return counted([parse_regex(pattern)])

    assert len(rules("[a-z]{1,500}")) == 1  # 500 states unrolled: left as it is
    root, item, count = rules("x.{2,500}y")  # a character of up to 4 bytes, 500 times
    assert root == ("cat", [("set", [(120, 120)]), ("call", 2), ("set", [(121, 121)])])
    assert item[0] == "set" and count == ("count", 1, 2, 500)
    assert len(rules("(a?){2000}")) == 1  # an item that may be empty: unrolled (and refused)
    nested = rules("(.{300}b){0,300}")  # the inner count its own rule, the outer over it
    assert nested == [("cat", [("call", 4)]), item, ("count", 1, 300, 300),
                      ("cat", [("call", 2), ("set", [(98, 98)])]), ("count", 3, 0, 300)]  # fmt: skip
    assert len(rules(".{300}|.{300}z|.{250}")) == 4  # one item rule, two counts
    assert len(rules(".{300}|.{300}z|.{240}")) == 3  # 960 states: unrolled


@pytest.fixture(scope="module")
def smol():  # noqa: ANN201
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    return tokenizer, GuideFactory(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


@pytest.mark.integration
def test_a_long_json_string_is_counted_to_the_character(smol):
    """``maxLength`` of 2,000 (refused before: its DFA needed about 50,000 states), compiled
    at once; a character is one whatever its spelling (``é``, ``\\n``, ``\\u00e9``, an emoji)."""
    tokenizer, factory = smol
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1000,
              "maxLength": 2000}}, "required": ["s"]}  # fmt: skip
    started = time.perf_counter()
    guide = factory.for_params(SamplingParams(json_schema=schema))
    assert isinstance(guide, PushdownGuide) and time.perf_counter() - started < 1.0
    unit = 'ab é\\n\\u00e9😀 cd\\".'  # 12 characters
    for count, ok in ((1000, True), (2000, True), (999, False), (2001, False)):
        body = unit * (count // 12) + "x" * (count % 12)
        document = '{"s": "' + body + '"}'
        assert len(json.loads(document)["s"]) == count
        assert accepted(guide, tokenizer, document) == ok, count


@pytest.mark.integration
def test_counted_masks_match_each_token_read_alone_on_a_real_vocabulary(smol):
    """SmolLM2's tokens read up to 81 bytes: at counts far from the bounds the masks are shared
    (one per context), near them each count has its own; either way the mask found for all
    tokens at once allows exactly the tokens that, read alone, keep a document reachable."""
    tokenizer, factory = smol
    eos = tokenizer.eos_token_id
    schema = {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 150},
              "maxItems": 3}  # fmt: skip
    guide = factory.for_params(SamplingParams(json_schema=schema))
    assert isinstance(guide, PushdownGuide) and guide.zones
    text = '["' + "Hello, wörld! " * 8 + 'x", "' + "Zürich\\n" * 18 + '1", "ab'
    ids = tokenizer.encode(text, add_special_tokens=False)
    state = guide.start()
    checked = 0
    for i, token in enumerate(ids):
        mask = guide.allowed(state)
        assert mask[token], tokenizer.decode(ids[: i + 1])
        if i in (3, 20, len(ids) // 2) or i > len(ids) - 3 or 30 <= i <= 32:
            alone = [guide.advance(state, t) is not None for t in range(len(tokenizer))]
            alone[eos] = bool(mask[eos])
            assert mask.tolist() == alone, tokenizer.decode(ids[: i + 1])
            checked += 1
        state = guide.advance(state, token)
    assert checked >= 6
    assert not accepted(guide, tokenizer, '["' + "a" * 151 + '"]')
    assert accepted(guide, tokenizer, '["' + "a" * 150 + '", "abc"]')


def test_a_count_that_may_begin_anywhere_keeps_a_bounded_state(make_llm, monkeypatch):
    """``(a|b)*a(a|b){2000}``: every ``a`` may begin the count, 2^2000 states as a DFA (refused
    before). Counted, a state keeps at most ``MAX_TOPS`` counts (the first): each token costs
    a bounded time, and what the guide allows is still the pattern's."""
    llm = make_llm()
    guide = counted_guide(llm, "(a|b)*a(a|b){2000}")
    a, b = (llm.tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab")
    state = guide.start()
    for token in [a, b] * 200:
        assert guide.allowed(state)[token]
        state = guide.advance(state, token)
    assert max(len(stacks.tops) for _, _, stacks in state) == pushdown.MAX_TOPS
    assert len(state) <= 3 * pushdown.MAX_TOPS  # configurations: a few per count kept
    monkeypatch.setattr(pushdown, "MAX_TOPS", 2)
    monkeypatch.setattr(counted_module, "COUNT_FROM", 1)
    monkeypatch.setattr(counted_module, "MIN_COUNT", 2)
    narrow = counted_guide(make_llm(), "(a|b)*a(a|b){3}")
    for n in range(9):
        for letters in itertools.product("ab", repeat=n):
            text = "".join(letters)
            if accepted(narrow, llm.tokenizer, text):  # fewer parses: never a wrong string
                assert re.fullmatch("(a|b)*a(a|b){3}", text), text
