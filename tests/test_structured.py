"""Guided regex and JSON Schema: the byte DFA against Python's ``re``, the schema's regex against
documents, the token index against the tokenizers' own decoding, and the engine's output: on the
pattern, decided from the model's logits over the allowed tokens, the same with any drafter."""

import json
import random
import re

import pytest
import torch
from scipy.stats import chisquare

from specdec import SamplingParams, SpecConfig, StructuredOutputsParams
from specdec.sequence import Sequence
from specdec.structured import automaton
from specdec.structured import guide as guide_module
from specdec.structured.guide import token_bytes
from specdec.structured.json_schema import free_json_regex, schema_regex
from specdec.structured.regex import compile_regex
from specdec.verifier import Verifier, draft_tokens
from tests.test_detokenizer import metaspace_tokenizer, smollm2_tokenizer
from tests.test_penalties import OracleDrafter
from tests.tiny import byte_tokenizer

PATTERNS = [
    r"[a-z]+", r"(ab|a)*c?", r"\d{2,4}-\w+", r"[^\"\\]*", r"é+|ü.", r"x{3}", r"(a|b){1,3}?",
    r"[\u00e0-\u0100a]+", r".*", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    r"[\s\S]{0,2}", r"\x41\u4e2d+", r"^(?:[^a-c\d]|\.)+$", r"[\w\-]+@[a-z]+\.(com|org)",
    r"[😀-😂]?中", r"\S\D\W", r"[]a]+|[^]]", r"a{,2}b{2,}", r"x{a}",
]  # fmt: skip
ALPHABET = 'abcé0129-_ "\\ü中A.\nxeE+@]😁😃\x00\u0100'


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_dfa_matches_what_python_matches_in_full(pattern):
    """Python's ``re`` with ``re.ASCII``: ``\\d \\w \\s`` are ASCII classes, as in JSON Schema's
    ECMA-262 patterns."""
    dfa, rng = compile_regex(pattern), random.Random(pattern)
    strings = ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(7))) for _ in range(3000)]
    strings += [s for s in ("abc", "é", "2024-x", "a@b.com", "A中中", "😁中", "]]", "a]") if s]
    for s in strings:
        assert dfa.fullmatch(s) == bool(re.fullmatch(pattern, s, re.ASCII)), (pattern, s)


@pytest.mark.parametrize(
    "pattern, message",
    [
        (r"(a)\1", "unsupported escape"),
        (r"(?=a)b", "lookarounds"),
        (r"a**", "repeated quantifiers"),
        (r"*a", "nothing to repeat"),
        (r"[z-a]", "bad range"),
        (r"a{5,2}", "out of range"),
        (r"a{200000}", "out of range"),
        (r"(ab", "missing \\)"),
        (r"[ab", "missing \\]"),
        (r"a^b", "only at the ends"),
        (r"\xZZ", "bad \\\\x escape"),
        ("(" * 101 + "a" + ")" * 101, "groups nest more than 100 deep"),
        ("(((a{100}){100}){100})", "more than 100000 automaton states"),
    ],
)
def test_unsupported_patterns_are_refused_by_what_they_use(pattern, message):
    with pytest.raises(ValueError, match=message):
        compile_regex(pattern)


def test_a_pattern_with_too_many_states_or_too_slow_to_compile_is_refused(monkeypatch):
    monkeypatch.setattr(automaton, "MAX_STATES", 64)
    with pytest.raises(ValueError, match="needs more than 64 states"):
        compile_regex("(a|b)*a(a|b){8}")  # 2**9 states: the classic subset-construction blow-up
    monkeypatch.setattr(automaton, "MAX_SECONDS", 0.0)
    with pytest.raises(ValueError, match="takes over 0 s to compile"):
        compile_regex("[a-z]+")


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", 1, None]}, "maxItems": 2},
        "home": {"$ref": "#/$defs/place"},
    },
    "required": ["name", "age"],
    "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest.mark.parametrize(
    "schema, document, valid",
    [
        (PERSON, '{"name": "Bo", "age": 3}', True),
        (PERSON, '{"name":"Bo","age":-0,"tags":[1, null],"home":{"city":"Ôr"}}', True),
        (PERSON, '{"name": "B\\"o\\u00e9", "age": 30, "home": {}}', True),
        (PERSON, '{"age": 3, "name": "Bo"}', False),  # properties come in the schema's order
        (PERSON, '{"name": "Bo"}', False),  # age is required
        (PERSON, '{"name": "Bo", "age": 3.5}', False),
        (PERSON, '{"name": "Bo", "age": 3, "tags": ["a", 1, 1]}', False),  # maxItems
        (PERSON, '{"name": "Bobbity boo", "age": 3}', False),  # maxLength
        (PERSON, '{"name": "Bo",  "age": 3}', False),  # at most one space between tokens
        ({"type": "object", "properties": {"a": {"type": "number"}}}, "{}", True),
        ({"type": "object", "properties": {"a": {"type": "number"}}}, '{"a": 1e-3}', True),
        ({"properties": {"a": {}, "b": {}}}, '{"b": [true]}', True),
        ({"properties": {"a": {}, "b": {}}}, '{, "b": 1}', False),
        ({"type": ["string", "null"], "format": "date"}, '"2024-02-29"', True),
        ({"type": "string", "format": "date"}, '"2024-13-01"', False),
        ({"anyOf": [{"const": "x"}, {"type": "boolean"}]}, "false", True),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1]", False),
        ({"type": "string", "pattern": "^[A-Z]{2}$"}, '"AB"', True),
    ],
)
def test_a_schemas_regex_matches_the_documents_it_accepts(schema, document, valid):
    assert compile_regex(schema_regex(schema)).fullmatch(document) is valid
    if valid:
        json.loads(document)


def test_free_form_json_nests_as_deep_as_the_bound():
    dfa = compile_regex(free_json_regex(top_object=True))
    assert dfa.fullmatch('{"a": [1, {"b": "c"}], "d": null}')
    assert not dfa.fullmatch('{"a": [1, {"b": [1]}]}')  # three levels below the top
    assert not dfa.fullmatch("[1]")  # an object at the top


def _nested(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "integer", "multipleOf": 2}, "keyword 'multipleOf' is not supported"),
        ({"type": "thing"}, "type 'thing' is not a JSON type"),
        ({"$ref": "#/$defs/missing"}, "names nothing in the schema"),
        ({"$defs": {"n": {"properties": {"k": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
         "nests more than 3 deep"),
        ({"properties": {"a": {}}, "required": ["b"]}, "requires 'b', not in properties"),
        ({"type": "string", "format": "iri"}, "format 'iri' is not supported"),
        ("{not json", "not valid JSON"),
        (_nested(70), "nests more than 64 deep"),
        (False, "accepts nothing"),
    ],
)  # fmt: skip
def test_unsupported_schemas_are_refused_by_name(schema, message):
    with pytest.raises(ValueError, match=message):
        schema_regex(schema)


@pytest.mark.parametrize("make_tokenizer", [byte_tokenizer, metaspace_tokenizer, smollm2_tokenizer])
def test_token_bytes_are_what_each_token_adds_to_the_text(make_tokenizer):
    tokenizer = make_tokenizer()
    spelled = token_bytes(tokenizer, len(tokenizer) + 3)
    assert spelled[-3:] == [b""] * 3  # ids past the tokenizer's own
    anchor = tokenizer.encode("b", add_special_tokens=False)
    before = tokenizer.decode(anchor)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    for i in range(len(tokenizer)):
        if i in special:
            assert spelled[i] == b""
            continue
        text = tokenizer.decode(anchor + [i])[len(before) :]
        if "\ufffd" not in text:
            assert spelled[i].decode() == text, i


def outputs(llm, prompts, params):  # noqa: ANN001
    return [o.token_ids for o in llm.generate(prompts, params)]


PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)) * 2, [7] * 13, [200]]
TREE = {  # a recursive schema: a pushdown guide's
    "$defs": {"node": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
    "$ref": "#/$defs/node",
}  # fmt: skip
GUIDED = [
    {"regex": r"(ab|c)+[0-9]{1,3}"},
    {"json_schema": {"properties": {"n": {"type": "integer"}, "s": {"enum": ["x", "yz"]}},
                     "required": ["s"]}},
    {"json_schema": TREE},
]  # fmt: skip


@pytest.mark.parametrize("guided", GUIDED)
def test_greedy_takes_the_best_allowed_token_at_every_step(make_llm, guided):
    llm = make_llm()
    guide = llm.engine.guides.for_params(SamplingParams(**guided))
    params = SamplingParams(temperature=0, max_tokens=40, **guided)
    eos = llm.engine.eos_token_ids
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        ids, state = [], guide.start()
        with torch.no_grad():
            while len(ids) < 40:
                logits = llm.hf_model(torch.tensor([prompt + ids])).logits[0, -1]
                allowed = guide.allowed(state)
                token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
                ids.append(token)
                if token in eos:
                    break
                state = guide.advance(state, token)
        assert out.token_ids == ids
        if ids[-1] in eos:  # a whole match, then the end
            text = llm.decode(ids[:-1])
            if "regex" in guided:
                assert re.fullmatch(guided["regex"], text)
            elif guided["json_schema"] is TREE:
                assert isinstance(json.loads(text)["v"], int)
            else:
                assert json.loads(text)["s"] in ("x", "yz")


def test_sampling_follows_the_models_law_over_the_allowed_tokens(make_llm):
    """Chi-square over 600 seeded draws of ``[ab][ab]`` at temperature 1 against the law written
    out from transformers' logits, renormalised over the allowed bytes at each step."""
    llm = make_llm()
    prompt, a, b = PROMPTS[1], *llm.tokenizer.encode("ab", add_special_tokens=False)
    expected = {}
    with torch.no_grad():
        first = llm.hf_model(torch.tensor([prompt])).logits[0, -1, [a, b]].double().softmax(0)
        for i, x in enumerate((a, b)):
            second = llm.hf_model(torch.tensor([prompt + [x]])).logits[0, -1, [a, b]]
            for j, y in enumerate((a, b)):
                expected[(x, y)] = float(first[i] * second.double().softmax(0)[j])
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=4, regex="[ab][ab]")
              for s in range(600)]  # fmt: skip
    counts = dict.fromkeys(expected, 0)
    for out in llm.generate([prompt] * 600, params):
        assert out.token_ids[2] in llm.engine.eos_token_ids
        counts[tuple(out.token_ids[:2])] += 1
    pairs = list(expected)
    assert chisquare([counts[p] for p in pairs], [expected[p] * 600 for p in pairs]).pvalue > 1e-3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("guided", GUIDED)
def test_speculation_keeps_the_guided_output(make_llm, guided, temperature):
    """Every draft accepted (an oracle), drafts mostly rejected (prompt lookup), the Triton
    verifier under the interpreter, and a batch mixing guided and free requests."""
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=24, **guided)
              for s in range(len(PROMPTS))]  # fmt: skip
    plain = outputs(make_llm(), PROMPTS, params)
    reference = {tuple(p): o for p, o in zip(PROMPTS, plain)}
    oracle = make_llm(speculative=SpecConfig(OracleDrafter(reference), 4, adaptive=False))
    lookup = make_llm(speculative=SpecConfig("prompt_lookup", 4, adaptive=False))
    triton = make_llm(speculative=SpecConfig(OracleDrafter(reference), 4, adaptive=False))
    triton.engine.verifier = Verifier("triton")
    for llm in (oracle, lookup, triton):
        assert outputs(llm, PROMPTS, params) == plain
    stats = oracle.engine.verifier.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    mixed = [SamplingParams(temperature=temperature, seed=i, max_tokens=16,
                            **(guided if i % 2 else {})) for i in range(8)]  # fmt: skip
    prompts = [PROMPTS[i % 4] for i in range(8)]
    assert outputs(lookup, prompts, mixed) == outputs(make_llm(), prompts, mixed)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"regex": 3}, "regex must be a non-empty string"),
        ({"json_schema": ["a"]}, "json_schema must be a dict or its JSON text"),
        ({"regex": "a", "choice": ["a"]}, "give one of choice, regex, json_schema, grammar"),
        ({"regex": "a", "ignore_eos": True}, "leave ignore_eos and min_tokens unset"),
        ({"json_schema": {}, "min_tokens": 1}, "leave ignore_eos and min_tokens unset"),
    ],
)
def test_bad_guided_parameters_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_a_pattern_the_engine_cannot_compile_leaves_no_request_behind(make_llm, monkeypatch):
    llm = make_llm()
    with pytest.raises(ValueError, match="lookarounds"):  # its syntax: refused at once
        SamplingParams(regex="(?=a)")
    monkeypatch.setattr(automaton, "MAX_STATES", 4)
    with pytest.raises(ValueError, match="needs more than 4 states"):  # its size: when added
        llm.generate([[1, 2], [3]], SamplingParams(regex="[a-z]{9}"))
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_drafts_follow_the_guide_as_the_target_will(make_llm):
    """A drafter's logits get the guide's mask at each draft's own state, so it proposes only
    tokens the target could accept; a row the mask leaves empty (a reduced draft vocabulary)
    still gives a draft, which the target then rejects."""
    llm = make_llm()
    params = SamplingParams(temperature=0, regex="ab[0-9]+")
    seq = Sequence(0, [5, 6], 2, params, eos_token_ids=llm.engine.eos_token_ids)
    seq.guide = llm.engine.guides.for_params(params)
    a, b, zero, z = llm.tokenizer.encode("ab0z", add_special_tokens=False)
    vocab = llm.engine.vocab_size
    logits = torch.zeros(1, vocab)
    logits[0, z] = 9.0  # the draft model's favourite, which the guide forbids
    assert draft_tokens(logits.clone(), [seq]) == [a]
    seq.spec_token_ids = [a, b]
    logits[0, zero] = 1.0
    assert draft_tokens(logits.clone(), [seq]) == [zero]
    outside = torch.full((1, vocab), float("-inf"))
    outside[0, z] = 0.0
    assert len(draft_tokens(outside, [seq])) == 1


COUNTED = {"json_schema": {"type": "string", "minLength": 20, "maxLength": 90}}  # a counter


@pytest.mark.parametrize("guided", [{"regex": r"[a-z ]{20,40}\."}, GUIDED[1], COUNTED])
def test_guided_output_holds_under_preemption_chunking_and_prefix_cache_hits(make_llm, guided):
    """Guides keep their states along the output, so a sequence preempted and recomputed, a
    prompt prefilled in chunks, or one served from the prefix cache, continues the same."""
    prompts = [list(range(10, 60)) + [i] for i in range(6)]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=30, **guided)
              for i, t in enumerate([0.0, 1.0] * 3)]  # fmt: skip
    reference = outputs(make_llm(), prompts, params)
    tight = make_llm(block_size=4, num_kv_blocks=34, max_num_batched_tokens=24,
                     speculative=SpecConfig("prompt_lookup", 3))  # fmt: skip
    got = tight.generate(prompts, params)
    assert [o.token_ids for o in got] == reference
    assert sum(o.metrics.num_preemptions for o in got) > 0
    cached = make_llm(block_size=4)
    cached.generate(prompts[:1], params[:1])
    again = cached.generate(prompts, params)
    assert [o.token_ids for o in again] == reference
    assert all(o.metrics.num_cached_tokens >= 48 for o in again)


def test_a_guide_keeps_a_bounded_number_of_masks_and_the_same_output(make_llm, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=30, json_schema=GUIDED[1]["json_schema"])
    reference = outputs(make_llm(), PROMPTS, params)
    monkeypatch.setattr(guide_module, "MASKS_KEPT", 2)
    llm = make_llm()
    assert outputs(llm, PROMPTS, params) == reference
    (guide,) = llm.engine.guides._cache.values()
    assert len(guide.masks) == 2


def test_vllms_structured_outputs_params_set_the_same_guides(make_llm):
    llm = make_llm()
    schema = GUIDED[1]["json_schema"]
    for ours, theirs in (
        ({"json_schema": schema}, StructuredOutputsParams(json=schema)),
        ({"regex": "[ab]+c"}, StructuredOutputsParams(regex="[ab]+c")),
        ({"choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
        ({"json_schema": {"type": "object"}}, StructuredOutputsParams(json_object=True)),
    ):
        expected = outputs(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=20, **ours))
        params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=theirs)
        assert outputs(llm, PROMPTS, params) == expected
    for options, message in (
        ({"structured_outputs": StructuredOutputsParams()}, "exactly one kind, got none"),
        ({"structured_outputs": StructuredOutputsParams(regex="a", choice=["a"])},
         "exactly one kind, got \\['regex', 'choice'\\]"),
        ({"structured_outputs": StructuredOutputsParams(grammar='root ::= "x"', regex="x")},
         "exactly one kind, got \\['regex', 'grammar'\\]"),
        ({"structured_outputs": StructuredOutputsParams(regex="a"), "regex": "b"},
         "give structured_outputs or regex, not both"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            SamplingParams(**options)


def test_drafts_the_guide_forbids_are_not_verified(make_llm, monkeypatch):
    """Prompt lookup copies "cab..." after the output's "ab" from a prompt of letters, which a
    guide of digits forbids: without the engine's cut those drafts are verified (and rejected);
    with it none is, and either way the output is plain decoding's."""
    plain = make_llm()
    prompt = plain.tokenizer.encode("abc" * 8, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=12, regex="ab[0-9]{3}")
    expected = outputs(plain, [prompt], params)
    allowed_drafts = Sequence.guided_drafts  # the guide's verdict, whatever the engine does

    def run() -> list[tuple[int, int]]:
        lookup = make_llm(speculative=SpecConfig("prompt_lookup", 4, adaptive=False))
        verify, verified = lookup.engine.verifier.verify, []

        def checked(out, res):  # noqa: ANN001, ANN202
            verified.extend((len(s.spec_token_ids), allowed_drafts(s)) for s in out.seqs)
            return verify(out, res)

        lookup.engine.verifier.verify = checked
        assert outputs(lookup, [prompt], params) == expected
        return verified

    assert all(n == allowed for n, allowed in run())
    monkeypatch.setattr(Sequence, "guided_drafts", lambda self: len(self.spec_token_ids))
    assert any(n > allowed for n, allowed in run())  # uncut, forbidden drafts get verified
