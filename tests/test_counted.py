"""Repetitions with large counts kept as counters (specdec/structured/counted.py): the strings a
counted guide takes against Python's ``re`` (small counts, counted by lowering the threshold),
its masks against reading each token alone on SmolLM2's vocabulary, and what it lifts: JSON
strings of thousands of characters, compiled at once."""

import itertools
import json
import random
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


def mask_matches_reading_alone(guide, tokenizer, text: str) -> None:  # noqa: ANN001
    """The mask after ``text`` allows exactly the tokens that, read alone, leave a state."""
    eos = tokenizer.eos_token_id
    state = guide.start()
    for token in tokenizer.encode(text, add_special_tokens=False):
        state = guide.advance(state, token)
    mask = guide.allowed(state)
    alone = [guide.advance(state, t) is not None for t in range(len(tokenizer))]
    alone[eos] = bool(mask[eos])
    assert mask.tolist() == alone, text[-20:]


@pytest.mark.integration
def test_counted_masks_match_each_token_read_alone_on_a_real_vocabulary(smol):
    """SmolLM2's tokens read up to 81 bytes (``"#" * 80`` is 80 characters of a JSON string):
    counts that no token can carry to a bound share their masks, near a bound each count has
    its own. At counts on either side of where the sharing stops, and at the bounds, the mask
    found for all tokens at once allows exactly the tokens that, read alone, leave a state."""
    tokenizer, factory = smol
    schema = {"type": "array", "items": {"type": "string", "minLength": 200, "maxLength": 400},
              "maxItems": 2}  # fmt: skip
    guide = factory.for_params(SamplingParams(json_schema=schema))
    assert isinstance(guide, PushdownGuide) and len(next(iter(guide.zones.values()))) == 2
    for count in (5, 118, 119, 120, 199, 200, 250, 319, 320, 321, 400):
        mask_matches_reading_alone(guide, tokenizer, '["' + "a" * count)
    mask_matches_reading_alone(guide, tokenizer, '["' + "ab" * 150 + '", "' + "é" * 120)
    # an item that may go on reading where it may end: "ab" is one reading, not "a" then "b"
    items = factory.for_params(SamplingParams(regex="(?:a|ab|#|b[cd]){10,300}"))
    assert isinstance(items, PushdownGuide)
    for text in ("", "ab" * 3, "abab" * 30 + "a", "ab" * 120 + "#" * 19, "ab" * 285):
        mask_matches_reading_alone(items, tokenizer, text)


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


def random_pattern(rng: random.Random, depth: int = 0) -> str:
    """A small pattern over ``ab``: letters, groups, alternatives, and counted repetitions
    (within one another too)."""
    kind = rng.choice(["letter", "letter", "cat", "alt", "rep", "rep"] if depth < 3 else ["letter"])
    if kind == "letter":
        return rng.choice(["a", "b", "[ab]", "ab"])
    if kind == "cat":
        return "".join(random_pattern(rng, depth + 1) for _ in range(rng.randint(2, 3)))
    if kind == "alt":
        return "(?:" + "|".join(random_pattern(rng, depth + 1) for _ in range(2)) + ")"
    low = rng.randint(0, 2)
    high = rng.choice([low, low + 1, low + 3, None]) if low else rng.choice([2, 3, None])
    return f"(?:{random_pattern(rng, depth + 1)}){{{low},{'' if high is None else high}}}"


def test_random_counted_patterns_take_exactly_their_strings(make_llm, monkeypatch):
    """100 random patterns, every repetition of two or more counted, against ``re.fullmatch``
    on every string of up to 7 letters."""
    monkeypatch.setattr(counted_module, "COUNT_FROM", 1)
    monkeypatch.setattr(counted_module, "MIN_COUNT", 2)
    llm, rng = make_llm(), random.Random(7)
    strings = ["".join(p) for n in range(8) for p in itertools.product("ab", repeat=n)]
    counted_patterns = 0
    for _ in range(100):
        pattern = random_pattern(rng)
        guide = llm.engine.guides.for_params(SamplingParams(regex=pattern))
        counted_patterns += isinstance(guide, PushdownGuide)
        for text in strings:
            expected = re.fullmatch(pattern, text) is not None
            assert accepted(guide, llm.tokenizer, text) == expected, (pattern, text)
    assert counted_patterns >= 40
