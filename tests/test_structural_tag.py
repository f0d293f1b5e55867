"""Structural tags: the strings each format accepts and refuses (free text, triggers, tags,
separators, excluded strings), the Aho-Corasick node against a brute-force check, the errors;
and the engine's output under a structural tag, the same with any drafter."""

import functools
import itertools
import json
import random

import pytest
import torch

from specdec import SamplingParams, SpecConfig, StructuredOutputsParams
from specdec.structured import automaton
from specdec.structured import guide as guide_module
from specdec.structured import regex as regex_module
from specdec.structured.pushdown import PushdownGuide
from specdec.structured.regex import compile_tree
from specdec.structured.structural_tag import structural_tag_rules
from tests.test_grammar import accepted
from tests.test_penalties import OracleDrafter

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
EMPTY = {"type": "object", "properties": {}}
WEATHER = {"begin": "<function=weather>", "schema": CITY, "end": "</function>"}
TIME = {"begin": "<function=time>", "schema": EMPTY, "end": "</function>"}
LEGACY = {"type": "structural_tag", "triggers": ["<function="], "structures": [WEATHER, TIME]}
CALL = '<function=weather>{"city": "Paris"}</function>'
NOW = "<function=time>{}</function>"


def tags(*structures: dict) -> list[dict]:
    return [
        {"begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
         "end": s["end"]}
        for s in structures
    ]  # fmt: skip


def triggered(**counts: bool) -> dict:
    f = {"type": "triggered_tags", "triggers": ["<function="], "tags": tags(WEATHER, TIME)}
    return {"type": "structural_tag", "format": {**f, **counts}}


def think_then(then: dict) -> dict:
    think = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}
    return {"format": {"type": "sequence", "elements": [think, then]}}


class Bytes:
    """A vocabulary of the 256 bytes, one token each: a guide reads a text byte by byte."""

    spelled, size, eos_token_ids = [bytes([b]) for b in range(256)], 256, list[int]()
    unspelled = torch.zeros(256, dtype=torch.bool)


def accepts(spec: dict | str, text: str) -> bool:
    """Whether the structural tag's guide reads ``text`` whole (a DFA, or a pushdown guide's
    automata where the tag nests)."""
    guide = guide_of(spec if isinstance(spec, str) else json.dumps(spec))
    state = guide.start()
    for byte in text.encode():
        state = guide.advance(state, byte)
        if state is None:
            return False
    return guide.complete(state)


@functools.cache
def guide_of(spec: str) -> PushdownGuide:
    return PushdownGuide([compile_tree(t, "tag") for t in structural_tag_rules(spec)], Bytes())


CASES = [
    (  # vLLM's first spelling: free text, and a structure wherever a trigger appears
        LEGACY,
        ["", "Let me check.", CALL, f"Sure: {CALL} and {NOW}.", CALL + CALL, "a <functio", "<f"],
        [
            "<function=",
            "<function=date>{}</function>",
            '<function=weather>{"town": "P"}</function>',
            CALL[:-1],
            f"{CALL} <function=x",
            '<function=weather> {"city": "P"}</function>',
        ],
    ),
    (triggered(), ["", "text", f"x{CALL}y{NOW}z"], ["<function=weather>", "a<function=b"]),
    (  # at_least_one: a tag first
        triggered(at_least_one=True),
        [CALL, f"{CALL} then {NOW}", f"{CALL} done"],
        ["", "hi", f"x{CALL}"],
    ),
    (  # stop_after_first: one tag at most, then nothing
        triggered(stop_after_first=True),
        ["", "hi", f"hi {CALL}", CALL],
        [f"{CALL} done", CALL + NOW],
    ),
    (triggered(at_least_one=True, stop_after_first=True), [CALL, NOW], ["", f"x{CALL}", CALL * 2]),
    (  # tags and separators only
        {"format": {"type": "tags_with_separator", "tags": tags(WEATHER, TIME), "separator": ","}},
        ["", CALL, f"{CALL},{NOW},{CALL}"],
        [f"{CALL}{NOW}", f"{CALL},", f"x{CALL}", f"{CALL}, {NOW}"],
    ),
    (
        {
            "format": {
                "type": "tags_with_separator",
                "tags": tags(TIME),
                "separator": "\n",
                "at_least_one": True,
            }
        },  # fmt: skip
        [NOW, f"{NOW}\n{NOW}"],
        ["", f"{NOW}\n"],
    ),
    (  # a tag's any_text never holds the tag's end
        think_then(triggered()["format"]),
        ["<think></think>", f"<think>a < b </think>ok {CALL}", "<think>x</thin</think>"],
        ["", "no think", "<think>unclosed", "<think>a</think>b<function=no>"],
    ),
    (
        think_then({"type": "const_string", "value": "X"}),
        ["<think>a</think>X", "<think></think>X"],
        ["<think>a</think>b</think>X", "<think>a</think>"],
    ),
    (
        {"format": {"type": "any_text", "excluded_str": ["bad", "worse"]}},
        ["", "good", "ba d", "wors"],
        ["bad", "so bad!", "worse"],
    ),
    (
        {
            "format": {
                "type": "or",
                "elements": [
                    {"type": "const_string", "value": "yes"},
                    {"type": "regex", "pattern": "[0-9]{2}"},
                    {"type": "grammar", "grammar": 'root ::= "(" root ")" | "x"'},
                ],
            }
        },  # fmt: skip
        ["yes", "42", "x", "((x))"],
        ["no", "4", "(x", "yes42"],
    ),
]


@pytest.mark.parametrize("spec, good, bad", CASES)
def test_a_structural_tag_accepts_its_strings_and_nothing_else(spec, good, bad):
    for text in good:
        assert accepts(spec, text), text
    for text in bad:
        assert not accepts(spec, text), text


def test_the_avoid_node_accepts_exactly_the_strings_holding_no_word():
    """Against a brute-force check on every string of up to 7 bytes over a small alphabet,
    with words that overlap themselves and each other (Aho-Corasick's failure links)."""
    for words in [(b"ab",), (b"aab", b"ba"), (b"aba", b"bb", b"c"), (b"abab", b"bab")]:
        dfa = compile_tree(("avoid", words), "test")
        for n in range(8):
            for letters in itertools.product(b"abc", repeat=n):
                text = bytes(letters)
                assert bool(dfa.accepting[dfa.walk(dfa.start, text)]) == (
                    not any(w in text for w in words)
                ), (words, text)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{", "structural_tag: not JSON"),
        ([], "structural_tag: must be an object"),
        ({"type": "json_schema"}, "structural_tag.type: must be 'structural_tag'"),
        ({"triggers": ["<f"]}, 'needs "format", or "structures" and "triggers"'),
        ({**LEGACY, "structures": []}, "structural_tag.structures: must be a non-empty list"),
        ({**LEGACY, "structures": [{"begin": "<f"}]}, r"structures\[0\]: needs schema, end"),
        (
            {**LEGACY, "triggers": ["<function=w", "<function="]},
            r"structural_tag.structures\[0\].begin: must start with exactly one trigger",
        ),
        ({**LEGACY, "triggers": ["<tool>"]}, "starts with none"),
        ({**LEGACY, "triggers": [""]}, r"triggers\[0\]: must be a non-empty string"),
        (
            {"format": {"type": "qwen_xml_parameter"}},
            "'qwen_xml_parameter' is not supported; use one of const_string",
        ),
        ({"format": {"type": "regex", "pattern": "a(?=b)"}}, r"format.pattern: regex"),
        ({"format": {"type": "grammar", "grammar": "root ::= x"}}, "format.grammar: grammar"),
        ({"format": {"type": "const_string", "value": "a", "extra": 1}}, "unknown field extra"),
        ({"format": {"type": "sequence", "elements": []}}, "elements: must be a non-empty list"),
        ({"format": {"type": "any_text", "excluded_str": "x"}}, "must be a list of strings"),
        ({"format": {**triggered()["format"], "at_least_one": "yes"}}, "must be true or false"),
        (
            {"format": {"type": "json_schema", "json_schema": {}, "style": "qwen_xml"}},
            "only 'json' is supported",
        ),
        (
            {"format": {"type": "tags_with_separator", "tags": [{"type": "or"}], "separator": ""}},
            r"tags\[0\]: must be a tag object",
        ),
    ],
)
def test_bad_structural_tags_are_refused_precisely(spec, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structural_tag=spec if isinstance(spec, str) else json.dumps(spec))


def test_a_structural_tag_that_nests_is_followed_to_any_depth(make_llm, monkeypatch):
    """A recursive grammar (or free-form JSON) in a structural tag is a pushdown guide's rule,
    followed to any depth, after a text too; a tag too large is refused at once, not compiled
    again."""
    nested = {"format": {"type": "tag", "begin": "<a>", "end": "</a>", "content": {
        "type": "grammar", "grammar": 'root ::= "(" root ")" | "x"'}}}  # fmt: skip
    monkeypatch.setattr(automaton, "MAX_STATES", 16)
    llm = make_llm()
    guides = llm.engine.guides
    for after in ("", "</think>"):
        params = SamplingParams(structural_tag=json.dumps(nested), guide_after=after or None)
        deep = guides.for_params(params)
        assert isinstance(deep, PushdownGuide)
        text = after + "<a>" + "(" * 30 + "x" + ")" * 30 + "</a>"
        assert accepted(deep, llm.tokenizer, text)
        assert not accepted(deep, llm.tokenizer, text.replace(")</a>", "</a>"))
    compiles = []
    monkeypatch.setattr(guide_module, "compile_tree", lambda t, n: compiles.append(t) or (
        regex_module.compile_tree(t, n)))  # fmt: skip
    wide = {"format": {"type": "regex", "pattern": "[a-z]{40}"}}
    with pytest.raises(ValueError, match="structural_tag: too large"):
        guides.for_params(SamplingParams(structural_tag=wide))
    assert len(compiles) == 1


def test_structured_outputs_and_its_kinds_take_a_structural_tag():
    text = json.dumps(LEGACY)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=text))
    assert params.structural_tag == text
    with pytest.raises(ValueError, match="exactly one kind"):
        StructuredOutputsParams(structural_tag=text, regex="a").guide()
    with pytest.raises(ValueError, match="give one of"):
        SamplingParams(structural_tag=text, regex="a")


PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)) * 2, [7] * 13, [200]]
SHORT = {"begin": "<f=a>", "schema": {"enum": [1, 22, 333]}, "end": "</f>"}
LOOSE = {"begin": "<f=b>", "schema": {"type": "string", "maxLength": 6}, "end": "</f>"}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("first", [True, False])
def test_the_engine_follows_a_structural_tag_with_any_drafter(make_llm, temperature, first):
    """With at_least_one the output opens with a tag, and without it the (random) model writes
    free text; either way every drafter gives plain decoding's tokens, and each output that
    ended is one the tag's guide takes whole."""
    spec = json.dumps({"format": {
        "type": "triggered_tags", "triggers": ["<f="], "tags": tags(SHORT, LOOSE),
        "at_least_one": first}})  # fmt: skip

    def outputs(llm, **guide):  # noqa: ANN001, ANN003
        params = [SamplingParams(temperature=temperature, seed=s, max_tokens=24, **guide)
                  for s in range(len(PROMPTS))]  # fmt: skip
        return [o.token_ids for o in llm.generate(PROMPTS, params)]

    llm = make_llm()
    plain = outputs(llm, structural_tag=spec)
    reference = {tuple(p): o for p, o in zip(PROMPTS, plain)}
    oracle = make_llm(speculative=SpecConfig(OracleDrafter(reference), 4, adaptive=False))
    lookup = make_llm(speculative=SpecConfig("prompt_lookup", 4, adaptive=False))
    assert outputs(oracle, structural_tag=spec) == plain == outputs(lookup, structural_tag=spec)
    for ids in plain:
        text = llm.decode(ids[:-1])
        if first:
            assert text.startswith("<f=a>") or text.startswith("<f=b>"), text
        if ids[-1] in llm.engine.eos_token_ids:
            assert accepts(spec, text), text
        else:
            assert len(ids) == 24


def test_free_text_opens_a_tag_at_its_trigger(make_llm):
    """Walked by hand through the guide: free text allows any byte; once the trigger is read,
    only the tags' begins may follow, then their content, then free text again."""
    spec = {"triggers": ["<f="], "structures": [SHORT, LOOSE]}
    llm = make_llm()
    guide = llm.engine.guides.for_params(SamplingParams(structural_tag=spec))
    ids = {b: llm.tokenizer.encode(chr(b), add_special_tokens=False)[0] for b in range(32, 127)}

    def allowed_after(text: str) -> set[str]:
        state = guide.start()
        for c in text:
            state = guide.advance(state, ids[ord(c)])
        mask = guide.allowed(state)
        return {chr(b) for b, i in ids.items() if mask[i]}

    assert len(allowed_after("hello ")) == len(ids)
    assert allowed_after("hi <f=") == {"a", "b"}
    assert allowed_after("<f=a>") == {"1", "2", "3"}
    assert allowed_after("<f=a>22</f") == {">"}
    assert len(allowed_after("<f=a>22</f> x")) == len(ids)
    rng = random.Random(0)
    for _ in range(40):  # free text (no trigger in it) allows every byte, however it ends
        text = "".join(rng.choice("ab< =f") for _ in range(12))
        if "<f=" not in text:
            assert len(allowed_after(text)) == len(ids), text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tag_opened_by_the_model_holds_its_content_to_the_schema(make_llm, temperature):
    """A logits processor makes the (random) model write the trigger after some free text; from
    there the tag's begin, content and end are the guide's, whatever the drafter."""
    hermes = {"triggers": ["<tool_call>"], "structures": [
        {"begin": '<tool_call>\n{"name": "f", "arguments": ', "end": "}\n</tool_call>",
         "schema": {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}}]}  # fmt: skip
    llm = make_llm()
    forced = llm.tokenizer.encode("ok <tool_call>", add_special_tokens=False)

    def opens(output_ids: list[int], logits):  # noqa: ANN001, ANN202
        if len(output_ids) < len(forced):
            keep = logits[forced[len(output_ids)]].clone()
            logits.fill_(float("-inf"))
            logits[forced[len(output_ids)]] = keep
        return logits

    def outputs(target) -> list[list[int]]:  # noqa: ANN001
        params = [SamplingParams(temperature=temperature, seed=s, max_tokens=96,
                                 structural_tag=hermes, logits_processors=[opens])
                  for s in range(len(PROMPTS))]  # fmt: skip
        return [o.token_ids for o in target.generate(PROMPTS, params)]

    def ended(ids: list[int]) -> bool:
        return ids[-1] in llm.engine.eos_token_ids

    plain = outputs(llm)
    reference = {tuple(p): o for p, o in zip(PROMPTS, plain)}
    oracle = make_llm(speculative=SpecConfig(OracleDrafter(reference), 4, adaptive=False))
    lookup = make_llm(speculative=SpecConfig("prompt_lookup", 4, adaptive=False))
    assert outputs(oracle) == plain == outputs(lookup)
    for ids in plain:
        text = llm.decode(ids)
        assert text.startswith('ok <tool_call>\n{"name": "f", "arguments": {'), text
        body = text.removeprefix("ok <tool_call>\n")
        call = json.loads(body[: body.index("\n</tool_call>")])  # closed within 96 tokens
        assert call["name"] == "f" and call["arguments"]["n"] in (1, 2), text
        assert accepts(hermes, llm.decode(ids[:-1]) if ended(ids) else text)


def test_free_form_json_in_a_tag_nests_to_any_depth(make_llm):
    """A tool whose arguments are any JSON object: its tag's content is the free-form value's
    rule, called as deep as the output nests; the free text around it stays free."""
    spec = {"triggers": ["<f="], "structures": [
        {"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}]}  # fmt: skip
    llm = make_llm()
    guide = llm.engine.guides.for_params(SamplingParams(structural_tag=spec))
    assert isinstance(guide, PushdownGuide)
    call = '<f=a>{"x": ' + "[" * 25 + "1" + "]" * 25 + "}</f>"
    assert accepted(guide, llm.tokenizer, f"text {call} more {call}")
    assert not accepted(guide, llm.tokenizer, "text " + call.replace("}</f>", "}}</f>"))
    assert not accepted(guide, llm.tokenizer, "text " + call.replace("]}", "}"))
