"""Grammars (EBNF and Lark) as regular expressions: the strings each accepts and refuses, its
recursion loops and bounds, its errors; and the engine's output under a grammar, the same with
any drafter and equal to the output under the grammar's regular expression."""

import functools
import json
import random
import re

import pytest

from specdec import SamplingParams, SpecConfig, StructuredOutputsParams
from specdec.structured import automaton
from specdec.structured import grammar as grammar_module
from specdec.structured import guide as guide_module
from specdec.structured.grammar import MAX_DEPTH, grammar_regex
from specdec.structured.pushdown import PushdownGuide
from specdec.structured.regex import DFA, TooLarge, compile_regex
from tests.test_penalties import OracleDrafter

SQL = """
    root ::= select_statement
    select_statement ::= "SELECT " column " from " table " where " condition
    column ::= "col_1 " | "col_2 "
    table ::= "table_1 " | "table_2 "
    condition ::= column "= " number
    number ::= "1 " | "2 "
"""  # vLLM's documentation's example
ARITHMETIC = r"""
# nested parentheses: recursion that is not a loop, so it is bounded
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
JSON_LARK = r"""
?start: value
?value: object | array | string | SIGNED_NUMBER -> number
      | "true" -> true | "false" -> false | "null" -> null
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS_INLINE
%ignore WS_INLINE   // spaces and tabs between any two terminals
"""


def accepts(grammar: str, text: str) -> bool:
    return dfa_of(grammar).fullmatch(text)


@functools.cache
def dfa_of(grammar: str) -> DFA:
    return compile_regex(grammar_regex(grammar))


@pytest.mark.parametrize(
    "grammar, good, bad",
    [
        (SQL, ["SELECT col_1  from table_2  where col_2 = 1 "],
         ["SELECT col_3  from table_1  where col_1 = 1 ", "SELECT col_1  from table_2 "]),
        (ARITHMETIC, ["1+2*3", "(1+(2*(3-4)))/7", "((12))"], ["1+", "()", "(1", "1 + 2"]),
        (r'root ::= [^"\\\n]{2,3} "\x41\u00e9\U0001F600" . [a-c-]? "\"\\"',
         ['ab\x41é😀\nc"\\', 'é😀xAé😀 -"\\'], ['a"Aé😀 "\\', 'abcdAé😀 "\\', 'abAé😀 d"\\']),
        ('root ::= ("a" | "bc"){2} "x"{1,} "y"{,2} "z"{3}?', ["abcxyy", "bcbcxxzzz"],
         ["axzzz", "aaxyyy", "aax zzz", "aaxzz"]),
        ('root ::= list\nlist ::= item | item "," list\nitem ::= [0-9]',  # a right loop
         ["1", ",".join("0123456789" * 3)], ["", "1,", ",1", "12"]),
        ('root ::= list\nlist ::= "x" | list "+" [ab]', ["x", "x+a+b+b+a+a+b"], ["x+", "+a"]),
        ('start: x ~ 2 y ~ 1..3 ["?"]\nx: "a".."c"\ny: "hi"i', ["abhIHI", "ccHi?"],
         ["aHi", "abhihihihi", "adhi"]),
        ('start: WORD+ "." -> sentence\n%import common (WORD, WS_INLINE)\n%ignore WS_INLINE',
         ["Hi there .", "x."], [" .", "a\n."]),
        ("start: /[a-z]+\\/[0-9]{2}/ NAME\nNAME.2: /[A-Z]/", ["ab/12Q"], ["ab12Q", "ab/12q"]),
        ('start: INT "/" DIGIT N\nDIGIT: "x"\n%import common.INT\n%import common.DIGIT -> N',
         ["12/x3"], ["12/33", "x/x3"]),  # an import's own rules apart from the grammar's
        (JSON_LARK, ['{"a": [1, -2.5e3, {"b": null}], "c": "x\\"y"}', " [ true , false ] "],
         ['{"a": }', "[1,]", '{"a" 1}', '"unterminated']),
    ],
)  # fmt: skip
def test_a_grammar_accepts_its_strings_and_nothing_else(grammar, good, bad):
    for text in good:
        assert accepts(grammar, text), text
    for text in bad:
        assert not accepts(grammar, text), text


def test_a_grammar_matches_what_its_hand_written_regex_matches():
    """Random strings over a small alphabet, against Python's ``re`` on the same language."""
    grammar = """
        root ::= (pair ("," pair)*)? ";"   # comments are skipped
        pair ::= key "=" [0-9]{1,2}
        key ::= [a-b] [a-b0-9_]* | "'" [^']* "'"
    """
    pair = r"(?:[ab][ab0-9_]*|'[^']*')=[0-9]{1,2}"
    expected = re.compile(f"(?:{pair}(?:,{pair})*)?;")
    dfa = compile_regex(grammar_regex(grammar))
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab1_=,;'x ") for _ in range(rng.randint(0, 10)))
        assert dfa.fullmatch(text) == bool(expected.fullmatch(text)), text


def test_recursion_that_is_not_a_loop_is_bounded():
    nested = "(" * (MAX_DEPTH - 1) + "1" + ")" * (MAX_DEPTH - 1)
    assert accepts(ARITHMETIC, nested)
    assert not accepts(ARITHMETIC, "(" + nested + ")")
    shallow = '{"a": {"b": {"c": 1}}}'  # start, then three containers: value open three times
    assert accepts(JSON_LARK, shallow) and not accepts(JSON_LARK, shallow.replace("1", "[1]"))
    mutual = 'root ::= a\na ::= "x" | "(" b ")"\nb ::= "[" a "]"'  # a and b call each other
    assert accepts(mutual, "([([x])])") and not accepts(mutual, "([([([([x])])])])")


JSON_EBNF = r"""
# JSON with integers only; "ws" after the tokens that may take it, a loop
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws (member ("," ws member)*)? "}" ws
member ::= string ":" ws value
array  ::= "[" ws (value ("," ws value)*)? "]" ws
string ::= "\"" (
    [^"\\\x00-\x1f] |                             # a character, or
    "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})     # an escape
  )* "\"" ws
number ::= "-"? ("0" | [1-9] [0-9]*) ws
ws     ::= ([ \t\n] ws)?
"""


AFTER = "</think>"  # a grammar after a text is one DFA, its recursion bounded


def test_a_recursive_grammar_after_a_text_is_followed_to_any_depth(make_llm):
    """After a text the pushdown guide's root automaton is joined to a free part: special tokens
    and any text until the text, then the grammar to any depth; with an opening, an output that
    does not open with it is guided from its first token."""
    llm = make_llm()
    deep = '{"a": ' * 12 + "[" * 12 + "1" + "]" * 12 + "}" * 12
    for opening in (None, "<think>"):
        params = SamplingParams(grammar=JSON_EBNF, guide_after=AFTER, guide_after_opening=opening)
        guide = llm.engine.guides.for_params(params)
        assert isinstance(guide, PushdownGuide)
        head = opening or ""
        assert accepted(guide, llm.tokenizer, head + "a < b" + AFTER + deep)
        assert not accepted(guide, llm.tokenizer, head + "a < b" + AFTER + deep[:-1])
        special = llm.tokenizer.bos_token_id  # a special token, not the end: free text only
        state = guide.start()
        for token in llm.tokenizer.encode(head, add_special_tokens=False):
            assert not guide.allowed(state)[special]  # the opening is not free yet
            state = guide.advance(state, token)
        assert guide.allowed(state)[special] and guide.advance(state, special) == state
        assert guide.advance(state, llm.tokenizer.eos_token_id) is None  # the end ends it
    assert accepted(guide, llm.tokenizer, deep)  # no opening: guided from the first token
    assert not accepted(guide, llm.tokenizer, "a" + AFTER + deep)


def accepted(guide, tokenizer, text: str) -> bool:  # noqa: ANN001
    """Whether a guide takes ``text`` (tokenized as the tokenizer does) and then the end."""
    state = guide.start()
    for token in tokenizer.encode(text, add_special_tokens=False):
        if state is None or not guide.allowed(state)[token]:
            return False
        state = guide.advance(state, token)
    return state is not None and bool(guide.allowed(state)[tokenizer.eos_token_id])


def test_a_recursive_grammar_is_followed_to_any_depth(make_llm):
    """Without a text before it, the grammar's recursion is a pushdown guide's: nesting is
    followed as deep as the output goes, and only whole documents end."""
    llm = make_llm()
    guide = llm.engine.guides.for_params(SamplingParams(grammar=JSON_EBNF))
    assert isinstance(guide, PushdownGuide)
    deep = '{"a": ' * 30 + "[" * 30 + "1" + "]" * 30 + "}" * 30
    for text in ['{"a": {"b": {"c": [1]}}}', deep, '{"a": [1, -20, {"b": true}], "c": "x"}']:
        assert accepted(guide, llm.tokenizer, text), text
    for text in [deep[:-1], deep + "}", '{"a": 01}', '{"a": 1,}', '{"a": [1}']:
        assert not accepted(guide, llm.tokenizer, text), text


def test_a_grammar_too_large_to_compile_is_refused_and_leaves_nothing_behind(make_llm, monkeypatch):
    monkeypatch.setattr(automaton, "MAX_STATES", 40)
    llm = make_llm()
    with pytest.raises(ValueError, match="grammar needs more than 40 states"):
        llm.generate([[1, 2]], SamplingParams(grammar=JSON_EBNF))
    assert not llm.engine.has_unfinished()
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_an_engine_keeps_a_bounded_number_of_guides(make_llm, monkeypatch):
    monkeypatch.setattr(guide_module, "GUIDE_CACHE", 3)
    guides = make_llm().engine.guides
    for i in range(6):
        guides.for_params(SamplingParams(grammar=f'root ::= "a{i}" | "(" root ")"'))
    assert len(guides._cache) == 3


@pytest.mark.parametrize(
    "grammar, message",
    [
        ("", "grammar must be a non-empty string"),
        ("just words", "no rule found"),
        ('rot ::= "a"', "no 'root' rule"),
        ('root ::= x\nx ::= "a"\nx ::= "b"', "rule 'x' is defined twice"),
        ("root ::= missing", "rule 'missing' is used but not defined"),
        ('root ::= "\\q"', "unsupported escape \\\\q"),
        ('root ::= "abc', "missing closing"),
        ("root ::= [a-", "missing closing"),
        ("root ::= [z-a]", "from high to low"),
        ('root ::= ("a"', "missing ')'"),
        ('root ::= "a"{3,1}', "from 3 down to 1"),
        ('root ::= "a"{x}', "bad repetition"),
        ('root ::= "a" @', "unexpected '@' at line 1"),
        ('root ::= root "a"', "matches no string"),
        ("start: /a/i", "regexp flags are not supported"),
        ("start: /a(?=b)/", "lookarounds"),
        ("start: x\n%import foo.BAR", "only %import common.NAME and %ignore"),
        ("start: NOPE\n%import common.NOPE", "common.NOPE is not one of"),
        ('start: "ab".."c"', "a range needs two single characters"),
        ('start: item{x}\nitem{x}: x', "template rules"),
    ],
)  # fmt: skip
def test_bad_grammars_are_refused_precisely(grammar, message):
    with pytest.raises(ValueError, match=re.escape(message) if "\\" not in message else message):
        grammar_regex(grammar)
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar=grammar)


def test_a_grammar_too_large_to_expand_is_refused(make_llm, monkeypatch):
    tree = 'root ::= "(" root root root ")" | "x"'  # each level three times the one below
    monkeypatch.setattr(grammar_module, "MAX_PATTERN", 200)
    grammar_module.grammar_regex.cache_clear()
    try:
        with pytest.raises(TooLarge, match="over 200 characters: nest its recursive rules less"):
            grammar_regex(tree)
        llm = make_llm()  # the guide's rules call each other: nothing to expand
        guide = llm.engine.guides.for_params(SamplingParams(grammar=tree, guide_after=AFTER))
        assert accepted(guide, llm.tokenizer, AFTER + "(x(x(xxx)x)x)")
        monkeypatch.setattr(grammar_module, "MAX_PATTERN", 20)
        grammar_module.grammar_regex.cache_clear()
        grammar_module.grammar_rules.cache_clear()
        with pytest.raises(ValueError, match="over 20 characters"):
            SamplingParams(grammar=tree)
    finally:
        grammar_module.grammar_regex.cache_clear()
        grammar_module.grammar_rules.cache_clear()


PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)) * 2, [7] * 13, [200]]
GRAMMARS = [
    'root ::= item ("," item)* "."\nitem ::= "ab" | "c" [0-9]{1,2} | "(" root ")"',
    'start: pair+ ";"\npair: KEY "=" /[0-9]+/\nKEY: "a".."d"\n%ignore " "',
]


def nesting(text: str) -> int:
    """How deep ``text``'s parentheses nest."""
    depth = deepest = 0
    for c in text:
        depth += {"(": 1, ")": -1}.get(c, 0)
        deepest = max(deepest, depth)
    return deepest


@pytest.mark.parametrize("grammar", GRAMMARS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_follows_a_grammar_as_its_regex_and_with_any_drafter(
    make_llm, grammar, temperature
):
    def outputs(llm, **guide):  # noqa: ANN001, ANN003
        params = [SamplingParams(temperature=temperature, seed=s, max_tokens=24, **guide)
                  for s in range(len(PROMPTS))]  # fmt: skip
        return [o.token_ids for o in llm.generate(PROMPTS, params)]

    llm = make_llm()
    plain = outputs(llm, grammar=grammar)
    # where no output nests 8 deep, a DFA bounded at 9 has the pushdown guide's masks
    assert max(nesting(llm.decode(ids)) for ids in plain) < 8
    assert plain == outputs(llm, regex=grammar_regex(grammar, 9))
    assert plain == outputs(llm, structured_outputs=StructuredOutputsParams(grammar=grammar))
    reference = {tuple(p): o for p, o in zip(PROMPTS, plain)}
    oracle = make_llm(speculative=SpecConfig(OracleDrafter(reference), 4, adaptive=False))
    lookup = make_llm(speculative=SpecConfig("prompt_lookup", 4, adaptive=False))
    assert outputs(oracle, grammar=grammar) == plain == outputs(lookup, grammar=grammar)
    dfa = compile_regex(grammar_regex(grammar))
    for ids in plain:
        text = llm.decode(ids[:-1])
        if ids[-1] in llm.engine.eos_token_ids:  # a whole derivation, then the end
            assert dfa.fullmatch(text), text
        else:  # cut by max_tokens: on the way to one
            assert len(ids) == 24


def test_a_json_grammar_gives_json(make_llm):
    """Lark's JSON example with JSON's own strings and numbers (Lark's common ones take more:
    ``.5``, ``"\\q"``)."""
    own = r"""
NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
STRING: "\"" /([^"\\\x00-\x1f]|\\["\\bfnrt]|\\u[0-9a-fA-F]{4})*/ "\""
%import common.WS_INLINE
%ignore WS_INLINE
"""
    strict = JSON_LARK.split("%import")[0].replace("SIGNED_NUMBER", "NUMBER") + own
    strict = strict.replace("ESCAPED_STRING", "STRING")
    assert accepts(strict, '{"a": [1, -2.5e3, "\\u00e9\\n"]}') and not accepts(strict, ".5")
    llm = make_llm()
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=48, grammar=strict)
              for s in range(16)]  # fmt: skip
    outs = llm.generate([PROMPTS[s % 4] for s in range(16)], params)
    ended = [o for o in outs if o.token_ids[-1] in llm.engine.eos_token_ids]
    assert ended
    for out in ended:
        json.loads(llm.decode(out.token_ids[:-1]))
