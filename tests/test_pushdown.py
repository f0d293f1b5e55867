"""The pushdown guide of recursive grammars: the strings it takes against brute-force checks
(nesting to any depth, ambiguity, left recursion through other rules), and its masks, found
for all tokens at once, against reading each token alone, on SmolLM2's vocabulary, whose
tokens close and open several levels at once."""

import itertools
import json
import re

import pytest
from transformers import AutoTokenizer

from specdec import SamplingParams
from specdec.loader import default_model_dir
from specdec.structured import guide as guide_module
from specdec.structured.guide import GuideFactory
from specdec.structured.json_schema import schema_rules
from specdec.structured.pushdown import PushdownGuide, StackTable
from tests.test_grammar import JSON_EBNF, accepted
from tests.test_structured import TREE

BALANCED = 'root ::= "(" root ")" root | ""'  # neither end is a loop: a call
MORE_A = 'root ::= "a" root "b" | "a" root | ""'  # a^n b^m, m <= n: ambiguous


def balanced(text: str) -> bool:
    depth = 0
    for c in text:
        depth += 1 if c == "(" else -1
        if depth < 0:
            return False
    return depth == 0


@pytest.mark.parametrize(
    "grammar, alphabet, reference",
    [
        (BALANCED, "()", balanced),
        (
            MORE_A,
            "ab",
            lambda t: re.fullmatch("(a*)(b*)", t) is not None and t.count("b") <= t.count("a"),
        ),  # fmt: skip
        (  # a left-recursive loop, then a call
            'root ::= e\ne ::= e "+" t | t\nt ::= "(" e ")" | "1"',
            "(+1)",
            lambda t: _sums(t),
        ),
    ],
)
def test_a_recursive_grammar_takes_exactly_its_strings(make_llm, grammar, alphabet, reference):
    """Every string of up to 10 characters (7 of 4 letters; one token each, the byte
    tokenizer's)."""
    llm = make_llm()
    guide = llm.engine.guides.for_params(SamplingParams(grammar=grammar))
    assert isinstance(guide, PushdownGuide)
    for n in range(11 if len(alphabet) < 4 else 8):
        for letters in itertools.product(alphabet, repeat=n):
            text = "".join(letters)
            assert accepted(guide, llm.tokenizer, text) == reference(text), text


def test_nesting_past_any_bound_is_followed(make_llm):
    llm = make_llm()
    guide = llm.engine.guides.for_params(SamplingParams(grammar=BALANCED))
    assert accepted(guide, llm.tokenizer, "(" * 200 + ")" * 200 + "()")
    assert not accepted(guide, llm.tokenizer, "(" * 200 + ")" * 199)


def test_an_ambiguous_grammar_holds_one_configuration_per_automaton_state(make_llm):
    """After n letters of ``MORE_A`` each open rule may or may not still owe its ``b``: 2^n
    stacks, which as separate configurations took seconds a token by the twelfth. Shared, a
    state holds at most one configuration per automaton state, at any depth."""
    llm = make_llm()
    guide = llm.engine.guides.for_params(SamplingParams(grammar=MORE_A))
    assert isinstance(guide, PushdownGuide)
    a = llm.tokenizer.encode("a", add_special_tokens=False)[0]
    state = guide.start()
    for _ in range(300):
        state = guide.advance(state, a)
    assert (
        len({(d, s) for d, s, _ in state})
        == len(state)
        <= sum(len(dfa.accepting) for dfa in guide.dfas)
    )
    assert max(stacks.depth for _, _, stacks in state) == 300
    assert accepted(guide, llm.tokenizer, "a" * 300 + "b" * 300)
    assert accepted(guide, llm.tokenizer, "a" * 300 + "b" * 17)
    assert not accepted(guide, llm.tokenizer, "a" * 300 + "b" * 301)


def test_an_ambiguous_recursive_schema_nests_deep(make_llm):
    """Each level may be either object of the ``anyOf`` until a ``b`` says which: 2^depth parses
    of the same text (8,192 configurations 40 tokens into it before they were shared)."""
    node = {
        "anyOf": [
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
            {
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"type": "integer"}},
                "required": ["b"],
            },
        ]
    }
    schema = {"$defs": {"n": node}, "$ref": "#/$defs/n"}
    llm = make_llm()
    guide = llm.engine.guides.for_params(SamplingParams(json_schema=schema))
    assert isinstance(guide, PushdownGuide)
    for depth in (1, 40):
        opened = '{"a": ' * depth + "{}"
        good = opened + ', "b": 1}' * (depth // 2) + "}" * (depth - depth // 2)
        assert accepted(guide, llm.tokenizer, good), depth
        json.loads(good)
        assert not accepted(guide, llm.tokenizer, opened + "}" * depth + ', "b": 1}')


def test_equal_sets_of_stacks_are_one_object():
    table = StackTable()
    one, two = table.push((0, 1), table.empty), table.push((0, 2), table.empty)
    both = table.union(one, two)
    assert table.union(two, one) is both and table.union(both, one) is both
    assert table.make(False, {(0, 1): table.empty, (0, 2): table.empty}) is both
    deep = [table.empty]  # every stack of 0s and 1s of each length up to 30
    for _ in range(30):
        grown = table.union(table.push((0, 0), deep[-1]), table.push((0, 1), deep[-1]))
        deep.append(table.union(grown, table.empty))
    assert deep[-1].depth == 30 and deep[-1].empty and set(deep[-1].tops) == {(0, 0), (0, 1)}
    assert deep[-1].tops[(0, 0)] is deep[-1].tops[(0, 1)] is deep[-2]


def _sums(text: str) -> bool:
    """Whether ``text`` is a sum of 1s and bracketed sums: brackets around a sum reduce to 1,
    innermost first, until what is left is a sum."""
    while (reduced := re.sub(r"\((1(\+1)*)\)", "1", text)) != text:
        text = reduced
    return re.fullmatch(r"1(\+1)*", text) is not None


def test_grammars_it_cannot_follow_are_refused():
    with pytest.raises(ValueError, match="the grammar matches no string"):
        SamplingParams(grammar='root ::= "(" root ")"')  # no end to its nesting
    params = SamplingParams(grammar='root ::= x | "b"\nx ::= "(" x ")" x')  # x never ends
    assert params.grammar is not None
    with pytest.raises(ValueError, match=r"rule 'a' is left-recursive \(through a -> b -> a\)"):
        SamplingParams(grammar='root ::= a\na ::= b "x" | "y"\nb ::= a "z"')
    hidden = 'root ::= a\na ::= q? b "x" | "y"\nb ::= a "z"\nq ::= "q"'  # behind what may be ""
    with pytest.raises(ValueError, match=r"through a -> b -> a"):
        SamplingParams(grammar=hidden)


C = r"""
root ::= (declaration)*
declaration ::= dataType identifier "(" parameter? ")" "{" statement* "}"
dataType  ::= "int" ws | "float" ws | "char" ws
identifier ::= [a-zA-Z_] [a-zA-Z_0-9]*
parameter ::= dataType identifier
statement ::= ( dataType identifier ws "=" ws expression ";" ) |
    ( identifier ws "=" ws expression ";" ) | ( "return" ws expression ";" ) |
    ( "while" "(" condition ")" "{" statement* "}" ) |
    ( "if" "(" condition ")" "{" statement* "}" ("else" "{" statement* "}")? )
condition ::= expression relationOperator expression
relationOperator ::= ("<=" | "<" | "==" | "!=" | ">=" | ">")
expression ::= term (("+" | "-") term)*
term ::= factor(("*" | "/") factor)*
factor ::= identifier | number | unaryTerm | funcCall | parenExpression
unaryTerm ::= "-" factor
funcCall ::= identifier "(" argList? ")"
parenExpression ::= "(" ws expression ws ")"
argList ::= expression ("," ws expression)*
number ::= [0-9]+
ws ::= ([ \t\n]+)
"""  # after llama.cpp's example C grammar: statements and expressions within each other


@pytest.mark.integration
@pytest.mark.parametrize(
    "grammar, text",
    [
        (JSON_EBNF, '{"a": [[[{"b": [1, {"c": {"d": [[]]}}]}]]], "e": "x\\n"}'),
        (C, "int f(int x){while(x<10){if(x==3){x = ( f(x-1)*( -2 ) );}}return x;}"),
    ],
)
def test_masks_match_each_token_read_alone_on_a_real_vocabulary(grammar, text):
    """SmolLM2's tokens (``"}]},``, ``"((("``) pop and push several levels within one token:
    at each state the text passes through, the mask found for all tokens at once allows a
    token exactly where reading that token alone leaves the grammar's strings reachable."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    eos = (tokenizer.eos_token_id,)
    guide = GuideFactory(tokenizer, len(tokenizer), eos).for_params(SamplingParams(grammar=grammar))
    assert isinstance(guide, PushdownGuide)
    state = guide.start()
    ids = tokenizer.encode(text, add_special_tokens=False)
    for i, token in enumerate(ids):
        mask = guide.allowed(state)
        assert mask[token]
        if i % 4 == 0:
            alone = [guide.advance(state, t) is not None for t in range(len(tokenizer))]
            alone[eos[0]] = bool(mask[eos[0]])
            assert mask.tolist() == alone, tokenizer.decode(ids[: i + 1])
        state = guide.advance(state, token)
    assert guide.allowed(state)[eos[0]]  # a whole derivation: the end may come


def test_free_form_and_recursive_json_nest_to_any_depth(make_llm):
    """Free-form values (``json_object``) and recursive ``$ref``s are rules of a pushdown guide:
    nesting is followed as deep as the output goes."""
    llm = make_llm()
    free = llm.engine.guides.for_params(SamplingParams(json_schema={"type": "object"}))
    tree = llm.engine.guides.for_params(SamplingParams(json_schema=TREE))
    assert isinstance(free, PushdownGuide) and isinstance(tree, PushdownGuide)
    deep = '{"a": ' + "[" * 20 + '{"b": null}' + "]" * 20 + "}"
    assert accepted(free, llm.tokenizer, deep) and accepted(free, llm.tokenizer, "{}")
    for text in ["[1]", deep[:-1], '{"a": 01}', '{"a": [1,]}']:
        assert not accepted(free, llm.tokenizer, text), text
    nodes = '{"v": 1, "kids": [' * 12 + '{"v": 2}' + "]}" * 12
    assert accepted(tree, llm.tokenizer, nodes)
    assert not accepted(tree, llm.tokenizer, nodes.replace('"v": 2', '"w": 2'))
    json.loads(nodes)


def test_a_guide_is_built_once_per_schema(make_llm, monkeypatch):
    """A schema's rules are written and compiled for its first request only, whichever guide
    it gets (one DFA, or a pushdown guide)."""
    written = []
    monkeypatch.setattr(guide_module, "schema_rules", lambda s: written.append(s) or (
        schema_rules(s)))  # fmt: skip
    guides = make_llm().engine.guides
    for schema in ({"type": "integer"}, {"type": "object"}):
        first = guides.for_params(SamplingParams(json_schema=schema))
        assert guides.for_params(SamplingParams(json_schema=schema)) is first
    assert len(written) == 2


def test_a_schema_whose_rules_never_end_is_refused(make_llm):
    """``{"$ref": "#"}`` is a rule that calls itself before anything else: no document; before,
    its guide allowed only the end, an empty output. Refused with the request's parameters."""
    llm = make_llm()
    for schema in ({"$ref": "#"}, {"allOf": [{"$ref": "#"}]}):
        with pytest.raises(ValueError, match="json_schema matches no document"):
            llm.generate([[1, 2, 3]], SamplingParams(json_schema=schema, max_tokens=4))
    ok = SamplingParams(json_schema={"type": "array", "items": {"$ref": "#"}}, max_tokens=4)
    assert llm.generate([[1, 2, 3]], ok)[0].outputs[0].text.startswith("[")
    looping = {"format": {"type": "json_schema", "json_schema": {"$ref": "#"}}}
    with pytest.raises(ValueError, match="structural_tag matches no string"):
        SamplingParams(structural_tag=looping)
