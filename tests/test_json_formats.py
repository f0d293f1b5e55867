"""JSON Schema string formats and keys that pydantic's types write, against the parsers that
read them: ``ipv6`` against Python's ``ipaddress``, ``duration`` against pydantic's
``timedelta``, the types whose format is any string, and dictionaries with constrained keys."""

import datetime
import enum
import ipaddress
import itertools
import json
import pathlib
import random
from typing import Annotated, Literal

import pytest
from pydantic import IPvAnyAddress, SecretStr, StringConstraints, TypeAdapter, ValidationError

from specdec.structured.json_schema import schema_regex, schema_rules
from specdec.structured.regex import compile_regex


def format_dfa(form: str):  # noqa: ANN201
    return compile_regex(schema_regex({"type": "string", "format": form}))


def ipv6_candidates(seed: int) -> set[str]:
    """Addresses as Python writes them (compressed, exploded, upper case, an IPv4 tail), the
    forms at the edges of "::", and each with a character inserted or removed."""
    rng = random.Random(seed)
    found = {"::", "::1", "1::", "1:2:3:4:5:6:7::", "::2:3:4:5:6:7:8", "1:2:3:4:5:6:7:8:9",
             "1::2::3", ":1::", "1:::2", "::1.2.3.4", "1:2:3:4:5:6:1.2.3.4", "1::1.2.3.4",
             "1:2:3:4:5:6:7:1.2.3.4", "1:2:3:4:5::1.2.3.4", "1:2:3:4:5:6::1.2.3.4",
             "::ffff:01.2.3.4", "12345::", "fe80::1%eth0"}  # fmt: skip
    for _ in range(600):
        zeros = (2**128 - 1) ^ (0xFFFF << 16 * rng.randrange(8))
        bits = rng.getrandbits(128) & rng.choice([2**128 - 1, zeros, 0xFFFFFFFF, 2**64 - 1])
        address = ipaddress.IPv6Address(bits)
        four = str(ipaddress.IPv4Address(rng.getrandbits(32)))
        found |= {str(address), address.exploded, str(address).upper(), "::ffff:" + four}
        if str(address).count(":") > 2:
            found.add(str(address).rsplit(":", 2)[0] + ":" + four)
    for text in list(found):
        i = rng.randrange(len(text) + 1)
        found |= {text[:i] + rng.choice(":0fg.") + text[i:], text[:i] + text[i + 1 :]}
    return found


def is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def test_ipv6_matches_what_python_reads():
    """Every candidate (8,628, 5,164 of them addresses): the format takes it exactly where
    ``ipaddress`` reads it, but for a scope (``%eth0``), which it leaves out."""
    dfa = format_dfa("ipv6")
    for text in ipv6_candidates(0):
        assert dfa.fullmatch(json.dumps(text)) == (is_ipv6(text) and "%" not in text), text
    both = format_dfa("ipvanyaddress")
    assert both.fullmatch('"10.0.0.1"') and both.fullmatch('"::1"')
    assert not both.fullmatch('"10.0.0"') and not both.fullmatch('"::1::"')
    schema = TypeAdapter(IPvAnyAddress).json_schema()
    assert schema_rules(schema) and schema["format"] == "ipvanyaddress"


def test_durations_are_what_pydantic_reads_and_writes():
    """ISO 8601 durations: every combination of parts the format takes, pydantic reads (it
    reads more: parts out of order); what pydantic writes, the format takes; no empty one."""
    adapter = TypeAdapter(datetime.timedelta)
    dfa = format_dfa("duration")
    parts = ["1Y", "2M", "3W", "4D", "T", "5H", "6M", "7S", "7.5S"]
    taken = 0
    for n in range(6):
        for combo in itertools.combinations(parts, n):
            text = "P" + "".join(combo)
            if dfa.fullmatch(json.dumps(text)):
                adapter.validate_python(text)
                taken += 1
    assert taken > 40
    for delta in (datetime.timedelta(hours=1, minutes=30), datetime.timedelta(days=-1, seconds=5),
                  datetime.timedelta(microseconds=5), datetime.timedelta(0),
                  datetime.timedelta(days=400)):  # fmt: skip
        written = adapter.dump_python(delta, mode="json")
        assert dfa.fullmatch(json.dumps(written)), written
    for text in ("P", "PT", "P1DT", "1D", "P1H", "PT1D", "P-1D", "P1.5D"):
        assert not dfa.fullmatch(json.dumps(text)), text
        if text in ("P", "PT"):
            with pytest.raises(ValidationError):
                adapter.validate_python(text)


@pytest.mark.parametrize("kind", [pathlib.Path, SecretStr, bytes])
def test_pydantic_types_whose_format_is_any_string(kind):
    """``path``, ``password``, ``binary``: a string, lengths kept, escapes as JSON writes them."""
    schema = TypeAdapter(kind).json_schema()
    dfa = compile_regex(schema_regex(schema))
    for text in ("", "a/b c", "C:\\dir\\f.txt", "é\n"):
        assert dfa.fullmatch(json.dumps(text)), text
    assert not dfa.fullmatch('"a"b"') and not dfa.fullmatch("1")
    short = compile_regex(schema_regex({**schema, "maxLength": 3}))
    assert short.fullmatch('"a\\nb"') and not short.fullmatch('"abcd"')


def test_dictionaries_with_constrained_keys():
    """pydantic's ``dict[Literal[...], V]``, ``dict[Enum, V]`` and ``dict[constr(max_length), V]``
    (``propertyNames``) and ``dict[constr(pattern), V]`` (``patternProperties``): keys the schema
    allows, values its own; what pydantic validates, the guide takes, and what it refuses, not."""

    class Unit(enum.Enum):
        C = "c"
        F = "f"

    short = Annotated[str, StringConstraints(max_length=3)]
    lower = Annotated[str, StringConstraints(pattern="^[a-z]+$")]
    cases = [
        (dict[Literal["x", "y"], int], ['{"x": 1, "y": 2}', "{}"], ['{"z": 1}', '{"x": "a"}']),
        (dict[Unit, int], ['{"c": 1}', '{"f": 2, "c": 3}'], ['{"k": 1}']),
        (dict[short, bool], ['{"abc": true}', '{"": false}'], ['{"abcd": true}']),
        (dict[lower, int], ['{"ab": 1, "c": 2}'], ['{"A": 1}', '{"a1": 1}', '{"a": "x"}']),
    ]
    for kind, good, bad in cases:
        adapter = TypeAdapter(kind)
        dfa = compile_regex(schema_regex(adapter.json_schema()))
        assert schema_rules(adapter.json_schema())  # the pushdown guide's rules too
        for text in good:
            assert dfa.fullmatch(text), (kind, text)
            adapter.validate_json(text)
        for text in bad:
            assert not dfa.fullmatch(text), (kind, text)
            with pytest.raises(ValidationError):
                adapter.validate_json(text)
    with pytest.raises(ValueError, match="on an object without properties"):
        schema_regex({"properties": {"a": {}}, "propertyNames": {"maxLength": 2}})
