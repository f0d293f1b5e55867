"""Stop strings and held-back text: cut exactly where plain decoding would, however tokens arrive."""

from __future__ import annotations

import random

import pytest

from specdec import SamplingParams
from specdec.detokenizer import held_back
from tests.test_speculative import ScriptedDrafter

PROMPT = [84, 85, 86, 5]  # the tiny model's greedy output has plain characters where needed
MAX_TOKENS = 19  # with 5 drafts accepted per step, tokens arrive as 1, 7, 13, 19: 14..19 together


def held_back_reference(text: str, stops: list[str]) -> int:
    """The longest end of ``text`` that is a proper prefix of a stop string (brute force)."""
    if text.endswith("\ufffd"):
        return len(text) - len(text.rstrip("\ufffd"))
    return max(
        (n for s in stops for n in range(1, len(s)) if n <= len(text) and text.endswith(s[:n])),
        default=0,
    )


def test_held_back_equals_the_brute_force_answer():
    rng = random.Random(0)
    for _ in range(3000):
        alphabet = "ab" if rng.random() < 0.5 else "abc\n"
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
            for _ in range(rng.randint(1, 4))
        ]
        assert held_back(text, stops) == held_back_reference(text, stops), (text, stops)
    assert held_back("abc\ufffd\ufffd", ["x"]) == 2


def test_held_back_stays_cheap_with_many_long_stop_strings():
    """The old scan built every prefix of every stop string: 1,000 stops of 3,000 characters
    meant 3 million `endswith` calls per step. The scan now visits only where a stop can start."""
    calls = 0

    class CountingStr(str):
        def find(self, *args):  # type: ignore[override]
            nonlocal calls
            calls += 1
            return super().find(*args)

        def endswith(self, *args):  # type: ignore[override]
            nonlocal calls
            calls += 1
            return super().endswith(*args)

    stops = [f"{i:04d}" + "x" * 2996 for i in range(1000)]
    text = CountingStr("some output text that ends in 12")
    assert held_back(text, stops) == 0
    assert calls <= 2 * len(stops)


def find_stop(llm, tokens: list[int], last: int) -> tuple[str, str]:
    """A stop string completed exactly by ``tokens[last - 1]``, and the text before it."""
    text = llm.engine.detokenizer.decode(tokens[:last])
    before = llm.engine.detokenizer.decode(tokens[: last - 1])
    for length in (1, 2, 3):
        stop = text[-length:]
        if "\ufffd" not in stop and text.find(stop) == len(text) - length and stop not in before:
            return stop, text[:-length]
    raise AssertionError(f"no stop string ends exactly at token {last} of {text!r}")


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("last", [MAX_TOKENS, MAX_TOKENS - 2])
def test_a_stop_string_in_the_step_that_ends_by_length_still_stops(make_llm, speculative, last):
    """Plain decoding stops at a stop string even when its last token is also the last one
    allowed; with speculation that step may carry several tokens after it as well."""
    options = (
        {
            "speculative": {
                "drafter": "prompt_lookup",
                "num_speculative_tokens": 5,
                "adaptive": False,
            }
        }
        if speculative
        else {}
    )
    llm = make_llm(**options)
    free = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )[0]
    if speculative:  # accept every draft: the step that reaches MAX_TOKENS brings six tokens
        llm.engine.drafter = ScriptedDrafter({tuple(PROMPT): free.token_ids}, k=5, wrong_at=5)
    stop, expected_text = find_stop(llm, free.token_ids, last)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    out = llm.generate([PROMPT], params)[0]
    assert out.text == expected_text
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: len(out.token_ids)] and len(out.token_ids) <= last
    streamed = list(llm.stream(PROMPT, params))
    assert "".join(d.text for d in streamed) == expected_text
    assert streamed[-1].finish_reason == "stop"
