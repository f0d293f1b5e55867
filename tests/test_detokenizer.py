"""Stop strings and held-back text: cut exactly where plain decoding would, however tokens arrive."""

from __future__ import annotations

import dataclasses
import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specdec import SamplingParams
from specdec.detokenizer import Detokenizer, held_back
from specdec.loader import default_model_dir
from specdec.sequence import Sequence
from tests.test_speculative import ScriptedDrafter
from tests.tiny import byte_tokenizer

PROMPT = [84, 85, 86, 5]  # the tiny model's greedy output has plain characters where needed
STOP_PROMPT = [65, 66, 67, 69]  # "bcdf", then plain characters first: ".s>"
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


def clean(text: str, start: int, length: int) -> str:
    """The first ``length`` characters of ``text`` from ``start`` on holding no incomplete one."""
    for i in range(start, len(text) - length + 1):
        if "\ufffd" not in text[i : i + length]:
            return text[i : i + length]
    raise AssertionError(f"no clean {length} characters in {text!r} from {start}")


def kept_by_transformers(decode, prompt: list[int], tokens: list[int], strings) -> int:  # noqa: ANN001
    """How many of ``tokens`` transformers' ``StopStringCriteria`` keeps (brute force): through
    the first whose text completes an occurrence, in the prompt's and output's text, that ends in
    the output."""
    context = decode(prompt)
    for n in range(1, len(tokens) + 1):
        whole = context + decode(tokens[:n])
        for s in strings:
            if any(whole.startswith(s, i) for i in range(len(context) - len(s) + 1, len(whole))):
                return n
    return len(tokens)


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("case", ["from-the-prompt", "inside", "first-to-end"])
def test_stop_strings_end_at_the_token_that_completes_one(make_llm, speculative, case):
    """transformers' ``stop_strings``: the output ends with the token that completes one, its
    text kept; one may begin in the prompt; of two, the one that ends first wins; the same when
    a verification step brings tokens past it."""
    spec = {"drafter": "prompt_lookup", "num_speculative_tokens": 5, "adaptive": False}
    llm = make_llm(**({"speculative": spec} if speculative else {}))
    free = llm.generate(
        [STOP_PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )[0]
    if speculative:  # accept every draft: steps bring six tokens
        llm.engine.drafter = ScriptedDrafter({tuple(STOP_PROMPT): free.token_ids}, k=5, wrong_at=5)
    decode = llm.engine.detokenizer.decode
    prompt_text = decode(STOP_PROMPT)
    if case == "from-the-prompt":
        strings = [prompt_text[-2:] + clean(free.text, 0, 2)]
        assert free.text.startswith(strings[0][2:])  # the first clean characters open it
    elif case == "inside":
        strings = [clean(free.text, 8, 3)]
    else:
        strings = [clean(free.text, 0, 3)]  # ".s>": tokens 1 to 3, the last two in one step
        strings.append(strings[0][1])  # "s", inside the first: it ends first
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_strings=strings
    )
    out = llm.generate([STOP_PROMPT], params)[0]
    n = kept_by_transformers(decode, STOP_PROMPT, free.token_ids, strings)
    assert n < len(free.token_ids)
    assert out.token_ids == free.token_ids[:n] and out.finish_reason == "stop"
    assert out.text == decode(free.token_ids[:n])  # kept in the text
    streamed = list(llm.stream(STOP_PROMPT, params))
    assert "".join(d.text for d in streamed) == out.text


@pytest.mark.parametrize(
    "options, message",
    [
        ({"stop_strings": [""]}, "stop_strings must be"),
        ({"stop_strings": [3]}, "stop_strings must be"),
        ({"stop_strings": ["a"], "stop": ["b"]}, "not both"),
        ({"stop": ["a"], "detokenize": False}, "need detokenize=True"),
        ({"stop_strings": ["a"], "detokenize": False}, "need detokenize=True"),
        ({"detokenize": 0}, "detokenize must be true or false"),
    ],
)
def test_bad_stop_strings_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)
    assert SamplingParams(stop_strings="ab").stop_strings == ["ab"]


def test_without_detokenizing_the_tokens_are_the_same_and_the_text_empty(make_llm):
    """vLLM's detokenize=False: tokens only (the detokenizer is never called)."""
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = llm.generate([PROMPT], params)[0]
    llm.engine.detokenizer = None  # type: ignore[assignment]
    bare = llm.generate([PROMPT], dataclasses.replace(params, detokenize=False))[0]
    assert bare.token_ids == text.token_ids and text.text and bare.text == ""
    deltas = list(llm.stream(PROMPT, SamplingParams(max_tokens=5, detokenize=False)))
    assert len(deltas) == 5 and all(d.text == "" for d in deltas)


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama 2's decoder): words with a leading "▁", byte
    fallback tokens, and one leading space stripped from the whole text."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁the", "▁cat", "▁sat", "▁", "at", "s", ".", "▁€", "\n", "▁a", "b"]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def smollm2_tokenizer() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(default_model_dir())


def units_of(tokenizer: PreTrainedTokenizerFast) -> list[list[int]]:
    """What a model emits: tokens that are text on their own, and characters that take several
    tokens (byte tokens, or byte-level pieces)."""
    whole = [[i] for i in range(len(tokenizer)) if "\ufffd" not in tokenizer.decode([i])]
    spelled = [tokenizer.encode(c, add_special_tokens=False) for c in ("é", "€", "😀", "中文")]
    return whole + spelled * (len(whole) // 40)  # about one unit in ten is spelled


@pytest.mark.parametrize("make_tokenizer", [byte_tokenizer, metaspace_tokenizer, smollm2_tokenizer])
def test_incremental_text_equals_a_decode_of_the_whole_output(make_tokenizer):
    """Tokens arrive 1 to 6 at a time, splitting characters; after every step the text equals
    one decode of all of them, and the text handed out only grows."""
    tokenizer = make_tokenizer()
    detokenizer = Detokenizer(tokenizer)
    units = units_of(tokenizer)
    rng = random.Random(0)
    for trial in range(40):
        seq = Sequence(trial, [0], 1, SamplingParams())
        stream = [t for _ in range(60) for t in rng.choice(units)]
        released = ""
        while seq.num_output_tokens < len(stream):
            seq.token_ids += stream[seq.num_output_tokens :][: rng.randint(1, 6)]
            whole = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            assert detokenizer._text(seq) == whole
            released += detokenizer.step(seq, None)  # type: ignore[arg-type]  # no stops
            assert whole.startswith(released)
        assert seq.read_offset > len(stream) / 2  # the window moved on: not the whole output
