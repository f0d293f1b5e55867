"""vLLM's StructuredOutputsParams options for JSON: the whitespace allowed between JSON tokens
(``whitespace_pattern``, ``disable_any_whitespace``), and the options with no effect here."""

import json

import pytest

from specdec import SamplingParams, StructuredOutputsParams
from specdec.structured.json_schema import schema_regex
from specdec.structured.regex import compile_regex

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a"]}}},
    "required": ["n", "tags"],
}


def dfa_of(**options):  # noqa: ANN003
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**options))
    assert params.json_schema is None and params.regex is not None
    return compile_regex(params.regex)


def test_whitespace_options_set_what_may_come_between_json_tokens():
    compact = dfa_of(json=SCHEMA, disable_any_whitespace=True)
    assert compact.fullmatch('{"n":1,"tags":["a","a"]}')
    assert not compact.fullmatch('{"n": 1,"tags":["a"]}')
    pretty = dfa_of(json=SCHEMA, whitespace_pattern=r"[ \n]*")
    assert pretty.fullmatch('{\n  "n": 1,\n  "tags": [\n    "a"\n  ]\n}')
    assert not pretty.fullmatch('{\t"n": 1, "tags": []}')
    free = dfa_of(json_object=True, disable_any_whitespace=True)
    assert free.fullmatch('{"x":[1,{"y":null}]}') and not free.fullmatch('{"x": 1}')
    default = compile_regex(schema_regex(SCHEMA))  # at most one space, as before
    assert default.fullmatch('{"n": 1, "tags": []}') and not default.fullmatch('{"n":  1}')
    same = SamplingParams(structured_outputs=StructuredOutputsParams(
        json=SCHEMA, disable_additional_properties=True, disable_fallback=True))  # fmt: skip
    assert same.json_schema == SCHEMA and same.regex is None  # they change nothing here


@pytest.mark.parametrize(
    "options, message",
    [
        ({"regex": "a+", "disable_any_whitespace": True}, "apply to json and json_object only"),
        ({"json": SCHEMA, "whitespace_pattern": "(?=x)"}, "lookarounds"),
        ({"json": SCHEMA, "structural_tag": "{}"}, "exactly one kind"),
        ({"structural_tag": "{}"}, 'structural_tag: needs "format"'),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=StructuredOutputsParams(**options))


def test_the_engine_writes_compact_json_when_asked(make_llm):
    llm = make_llm()
    compact = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    prompts = [[1, 2, 3], list(range(10, 40))]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=compact)
              for s in range(2)]  # fmt: skip
    outs = llm.generate(prompts, params)
    reference = [SamplingParams(temperature=1.0, seed=s, max_tokens=40,
                                regex=schema_regex(SCHEMA, "")) for s in range(2)]  # fmt: skip
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, reference)]
    for out in outs:
        text = llm.decode(out.token_ids[:-1])
        if out.token_ids[-1] in llm.engine.eos_token_ids:
            assert json.loads(text)["n"] is not None and " " not in text


def test_vllms_older_guided_decoding_params_set_the_same_guides():
    from specdec import GuidedDecodingParams

    old = SamplingParams(guided_decoding=GuidedDecodingParams(json=SCHEMA, backend="xgrammar"))
    assert old.json_schema == SCHEMA and old.regex is None
    grammar = SamplingParams(guided_decoding=GuidedDecodingParams(grammar='root ::= "x"'))
    assert grammar.grammar == 'root ::= "x"'
    compact = SamplingParams(
        guided_decoding=GuidedDecodingParams(json=SCHEMA, disable_any_whitespace=True)
    )
    assert compact.regex == schema_regex(SCHEMA, "")
    new = StructuredOutputsParams(regex="a")
    with pytest.raises(ValueError, match="give structured_outputs or guided_decoding, not both"):
        SamplingParams(structured_outputs=new, guided_decoding=GuidedDecodingParams(regex="a"))
    with pytest.raises(ValueError, match="give guided_decoding or regex, not both"):
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="a"), regex="b")
