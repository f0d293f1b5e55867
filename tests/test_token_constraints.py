"""``allowed_token_ids`` and ``bad_words`` (vLLM's), and transformers' ``no_repeat_ngram_size``,
``bad_words_ids``, ``suppress_tokens``, forcing rules and length decay: what they keep out of
(or put in) the output, the same
output with a drafter as without (verification row j bans with the first j drafts counted), and
clear errors for bad values."""

import random
from dataclasses import replace

import pytest
import torch
import transformers

from specdec import SamplingParams, SpecConfig
from specdec.drafters import DrafterBase
from specdec.engine import bad_word_token_ids
from specdec.sequence import Sequence
from specdec.token_rules import apply_position_rules, repeated_ngram_ends, sequence_bias_row
from specdec.verifier import banned_word_ends
from tests.tiny import byte_tokenizer

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)) * 2, [7] * 13, [200]]
LETTERS = "abcde "


def letter_ids() -> list[int]:
    return [byte_tokenizer().encode(c, add_special_tokens=False)[0] for c in LETTERS]


class OracleDrafter(DrafterBase):
    """Drafts the reference continuation: every draft is accepted, so each verification row must
    apply the constraints with the drafts before it counted as output."""

    name = "oracle"

    def __init__(self, reference: dict[tuple[int, ...], list[int]]):
        self.reference = reference

    def propose(self, seqs: list[Sequence], num_drafts: list[int], step=None) -> None:  # noqa: ANN001
        for seq, k in zip(seqs, num_drafts):
            future = self.reference[tuple(seq.prompt_token_ids)][seq.num_output_tokens :]
            seq.spec_token_ids = future[:k]


def same_with_drafters(make_llm, params: list[SamplingParams]) -> list[list[int]]:  # noqa: ANN001
    """The plain outputs, after checking that an oracle and prompt lookup give them too."""
    plain = [o.token_ids for o in make_llm(block_size=4).generate(PROMPTS, params)]
    reference = {tuple(p): out for p, out in zip(PROMPTS, plain)}
    oracle = make_llm(speculative=SpecConfig(OracleDrafter(reference), 6, adaptive=False))
    lookup = make_llm(
        speculative={"drafter": "prompt_lookup", "num_speculative_tokens": 5, "adaptive": False},
        block_size=4,
    )
    for llm in (oracle, lookup):
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == plain
    stats = oracle.engine.verifier.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    return plain


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_are_all_the_output_holds(make_llm, temperature):
    allowed = letter_ids()
    params = [
        SamplingParams(temperature=temperature, seed=s, max_tokens=24, allowed_token_ids=allowed)
        for s in range(len(PROMPTS))
    ]
    outputs = same_with_drafters(make_llm, params)
    assert all(set(out) <= set(allowed) and len(out) == 24 for out in outputs)  # no EOS listed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bad_words_never_appear_and_drafts_change_nothing(make_llm, temperature):
    def params(bad_words: list[str] | None) -> list[SamplingParams]:
        return [
            SamplingParams(
                temperature=temperature,
                seed=s,
                max_tokens=40,
                allowed_token_ids=letter_ids(),
                bad_words=bad_words,
            )
            for s in range(len(PROMPTS))
        ]

    free = make_llm().generate(PROMPTS, params(None))
    text = "".join(o.text for o in free)
    bigrams = {a + b for a in LETTERS for b in LETTERS if a + b in text and " " not in a + b}
    words = sorted(bigrams, key=text.count)[-2:] + ["e"]  # the two most frequent pairs
    assert len(bigrams) >= 2 and "e" in text  # so each ban changes the output
    outputs = same_with_drafters(make_llm, params(words))
    decode = byte_tokenizer().decode
    for out in outputs:
        assert "e" not in decode(out)
        assert not any(w in decode(out) for w in words[:2])


def test_bad_word_ends_read_the_output_and_the_drafts_before_the_row():
    seq = Sequence(0, [5, 6, 1, 2], 2, SamplingParams())  # prompt [5, 6], output [1, 2]
    seq.bad_word_ids = [[2, 3, 4], [6, 9], [7]]
    seq.spec_token_ids = [3, 8]
    assert banned_word_ends(seq, 0) == [7]  # the output ends [1, 2], not [2, 3]
    assert banned_word_ends(seq, 1) == [4, 7]  # [2] + the first draft [3]: 4 would end the word
    assert banned_word_ends(seq, 2) == [7]
    seq.token_ids = [5, 6]  # no output yet: the prompt's 6 does not start a bad word
    seq.spec_token_ids = []
    assert banned_word_ends(seq, 0) == [7]


@pytest.mark.parametrize(
    "field, bad",
    [
        ("allowed_token_ids", []),
        ("allowed_token_ids", [3, -1]),
        ("allowed_token_ids", [True]),
        ("allowed_token_ids", 5),
        ("bad_words", ["ok", "  "]),
        ("bad_words", "word"),
        ("bad_words", [3]),
        ("suppress_tokens", [-1]),
        ("bad_words_ids", [[]]),
        ("bad_words_ids", [1, 2]),
        ("no_repeat_ngram_size", -1),
        ("no_repeat_ngram_size", True),
        ("begin_suppress_tokens", [2, -3]),
        ("begin_suppress_tokens", 4),
        ("sequence_bias", {(): 1.0}),
        ("sequence_bias", {(1, -2): 1.0}),
        ("sequence_bias", {(1,): float("inf")}),
        ("sequence_bias", {(1,): "high"}),
        ("sequence_bias", [[[1, 2]]]),
        ("sequence_bias", 3.0),
        ("forced_bos_token_id", -1),
        ("forced_bos_token_id", [3]),
        ("forced_eos_token_id", []),
        ("forced_eos_token_id", [1, -2]),
        ("forced_eos_token_id", True),
        ("exponential_decay_length_penalty", (3,)),
        ("exponential_decay_length_penalty", (-1, 1.5)),
        ("exponential_decay_length_penalty", (2, 0.0)),
        ("exponential_decay_length_penalty", (2, float("inf"))),
        ("exponential_decay_length_penalty", (2.5, 1.5)),
    ],
)
def test_bad_constraints_are_refused(field, bad):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: bad})


def test_allowed_ids_outside_the_vocabulary_are_refused(make_llm):
    llm = make_llm()
    with pytest.raises(ValueError, match=r"allowed_token_ids token ids must lie in \[0, 300\)"):
        llm.generate([[1, 2]], SamplingParams(allowed_token_ids=[1, 300]))
    with pytest.raises(ValueError, match=r"bad_words_ids token ids must lie in \[0, 300\)"):
        llm.generate([[1, 2]], SamplingParams(bad_words_ids=[[4, 5], [300]]))
    with pytest.raises(ValueError, match=r"sequence_bias token ids must lie in \[0, 300\)"):
        llm.generate([[1, 2]], SamplingParams(sequence_bias={(4, 300): 1.0}))
    with pytest.raises(ValueError, match=r"begin_suppress_tokens token ids must lie in"):
        llm.generate([[1, 2]], SamplingParams(begin_suppress_tokens=[301]))
    with pytest.raises(ValueError, match=r"forced_eos_token_id token ids must lie in"):
        llm.generate([[1, 2]], SamplingParams(forced_eos_token_id=[3, 300]))
    with pytest.raises(ValueError, match=r"forced_bos_token_id token ids must lie in"):
        llm.generate([[1, 2]], SamplingParams(forced_bos_token_id=300))


def test_sequence_bias_takes_transformers_list_form():
    pairs = [[[5], -2.0], [[3, 4], 1.5]]
    assert SamplingParams(sequence_bias=pairs).sequence_bias == {(5,): -2.0, (3, 4): 1.5}


def generate_rules(case: str, free: list[list[int]]) -> dict:
    """The rules of ``case``; token ids from the unconstrained outputs ``free``, so they bite."""
    if case == "ngram-2":
        return {"no_repeat_ngram_size": 2}
    if case == "ngram-1-suppress":
        return {"no_repeat_ngram_size": 1, "suppress_tokens": [free[0][0], free[3][2]]}
    if case == "begin-suppress":  # alone: the greedy path must not skip it
        return {"begin_suppress_tokens": [out[0] for out in free]}
    if case == "sequence-bias-begin":  # a ban by bias, a nudge after two tokens, no first token
        bias = {(free[1][2],): -100.0, tuple(free[0][3:5]): -30.0, (free[2][1], free[0][0]): 4.0}
        return {"sequence_bias": bias, "begin_suppress_tokens": [out[0] for out in free]}
    words = [free[0][2:4], [free[1][1]], free[2][3:6]]  # words the free outputs hold
    return {"bad_words_ids": words, "no_repeat_ngram_size": 4}


@pytest.mark.parametrize(
    "case",
    ["ngram-2", "ngram-1-suppress", "bad-words-ids", "begin-suppress", "sequence-bias-begin"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_rules_hold_the_same_with_drafters(make_llm, case, temperature):
    """transformers' rules (what specdec.wrap passes on), over the prompt and the output: no
    n-gram twice, no bad word completed, no suppressed token (nor a first token suppressed at
    the start), a sequence's bias where its first tokens end the context, whatever drafts ran."""
    params = [
        SamplingParams(temperature=temperature, seed=s, max_tokens=30, ignore_eos=True)
        for s in range(len(PROMPTS))
    ]
    free = [o.token_ids for o in make_llm().generate(PROMPTS, params)]
    rules = generate_rules(case, free)
    outputs = same_with_drafters(make_llm, [replace(p, **rules) for p in params])
    assert outputs != free
    n = rules.get("no_repeat_ngram_size", 0)
    for prompt, out in zip(PROMPTS, outputs):
        tokens = prompt + out
        assert not set(out) & set(rules.get("suppress_tokens", []))
        assert out[0] not in rules.get("begin_suppress_tokens", [])
        banned = [key[0] for key, b in rules.get("sequence_bias", {}).items() if b == -100]
        assert not set(out) & set(banned)
        for end in range(max(len(prompt), n - 1), len(tokens) if n else 0):  # each new token
            gram = tokens[end - n + 1 : end + 1]
            earlier = [tokens[i : i + n] for i in range(end - n + 1)]
            assert gram not in earlier, f"token {end} repeats the {n}-gram {gram}"
        for word in rules.get("bad_words_ids", []):
            starts = range(len(prompt) - len(word) + 1, len(tokens) - len(word) + 1)
            assert all(tokens[i : i + len(word)] != word for i in starts), "a bad word completed"


def test_sequence_bias_row_is_transformers():
    """Biases of one-token and longer sequences, last tokens shared, prefixes longer than the
    context: the vector transformers' processor adds, bit for bit."""
    rng = random.Random(1)
    for _ in range(200):
        bias: dict[tuple[int, ...], float] = {}
        for _ in range(rng.randrange(1, 6)):
            key = tuple(rng.randrange(5) for _ in range(rng.randrange(1, 4)))
            bias[key] = rng.choice([-100.0, -2.5, 0.3, 1.7, 7.0])
        context = [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
        processor = transformers.SequenceBiasLogitsProcessor(sequence_bias=bias)
        logits = torch.randn(1, 5)
        expected = processor(torch.tensor([context]), logits.clone())[0]
        assert torch.equal(logits[0] + sequence_bias_row(bias, context, 5), expected), bias


def test_repeated_ngram_ends_are_transformers():
    rng = random.Random(0)
    for _ in range(200):
        context = [rng.randrange(5) for _ in range(rng.randrange(0, 30))]
        n = rng.randrange(1, 5)
        processor = transformers.NoRepeatNGramLogitsProcessor(n)
        scores = processor(torch.tensor([context or [0]])[:, : len(context)], torch.zeros(1, 5))
        expected = sorted(torch.nonzero(scores[0] == float("-inf")).flatten().tolist())
        assert sorted(repeated_ngram_ends(context, n)) == expected, (context, n)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(make_llm):
    llm = make_llm()
    prompt = list(range(1, 200)) * 3  # 597 tokens: more than the context of 512 holds
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):  # the error says what to do
        llm.generate([prompt], greedy)
    out = llm.generate([prompt], replace(greedy, truncate_prompt_tokens=40))[0]
    assert out.prompt_token_ids == prompt[-40:]
    assert out.token_ids == llm.generate([prompt[-40:]], greedy)[0].token_ids
    fit = llm.generate([prompt], replace(greedy, truncate_prompt_tokens=-1))[0]
    assert fit.prompt_token_ids == prompt[-511:] and len(fit.token_ids) == 1  # the context is full
    assert fit.finish_reason == "length"
    short = llm.generate([prompt[:10]], replace(greedy, truncate_prompt_tokens=40))[0]
    assert short.prompt_token_ids == prompt[:10]


@pytest.mark.parametrize("bad", [0, -2, True, 1.5])
def test_bad_truncation_is_refused(bad):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=bad)


class WordTokenizer:
    """Spells each text by a table, as a BPE tokenizer would: a word after a space may be one
    token of its own (" very"), or the space may be a token of its own (" ab" as three)."""

    SPELLINGS = {"very": [7], " very": [8], "ab": [1, 2], " ab": [3, 1, 2], "good day": [4, 5]}
    SPELLINGS[" good day"] = [6, 5]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.SPELLINGS[text]


def test_bad_words_take_the_spaced_spelling_where_it_is_another_word():
    ids = bad_word_token_ids(WordTokenizer(), ["very", "  ab", "good day"])
    # " ab" has another length: only "ab" (which " ab" ends with anyway)
    assert ids == [[7], [8], [1, 2], [4, 5], [6, 5]]


@pytest.mark.parametrize(
    "cut", [{"typical_p": 0.5}, {"epsilon_cutoff": 0.005}, {"eta_cutoff": 0.02, "top_k": 50}]
)
def test_transformers_warpers_sample_the_same_with_drafters(make_llm, cut):
    """Seeded sampling with typical, epsilon or eta cut: the plain outputs, whatever drafts ran
    (the verifier and the drafters read the same processed distribution)."""
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=30, ignore_eos=True)
        for s in range(len(PROMPTS))
    ]
    free = [o.token_ids for o in make_llm().generate(PROMPTS, params)]
    assert same_with_drafters(make_llm, [replace(p, **cut) for p in params]) != free


def test_position_rules_are_transformers():
    """Forced BOS and EOS and the exponential length decay on random rows (end-of-sequence
    logits negative, positive and -inf): the values of transformers' processors, bit for bit."""
    rng = random.Random(2)
    fired = 0
    for _ in range(300):
        prompt_len, generated = rng.choice([1, 1, 3]), rng.randrange(0, 8)
        max_tokens = generated + rng.randrange(1, 3)
        bos, eos_ids = rng.choice([None, 4]), rng.sample(range(6), rng.randrange(1, 3))
        forced_eos = rng.choice([None, 2, [1, 5]])
        decay = rng.choice([None, (2, 1.3), (0, 0.7), (5, 2.0)])
        params = SamplingParams(max_tokens=max_tokens, forced_bos_token_id=bos,
                                forced_eos_token_id=forced_eos,
                                exponential_decay_length_penalty=decay)  # fmt: skip
        row = torch.randn(6) * 5
        if rng.random() < 0.3:
            row[rng.choice(eos_ids)] = float("-inf")
        processors = []
        if bos is not None:
            processors.append(transformers.ForcedBOSTokenLogitsProcessor(bos))
        if forced_eos is not None:
            processors.append(
                transformers.ForcedEOSTokenLogitsProcessor(prompt_len + max_tokens, forced_eos)
            )
        if decay is not None:
            processors.append(
                transformers.ExponentialDecayLengthPenalty(decay, eos_ids, prompt_len)
            )
        expected = row[None].clone()
        for processor in processors:
            expected = processor(torch.zeros(1, prompt_len + generated, dtype=torch.long), expected)
        ours = row.clone()
        apply_position_rules(ours, params, generated, prompt_len, eos_ids)
        assert torch.equal(ours, expected[0]), (params, generated, prompt_len)
        fired += not torch.equal(ours, row)
    assert fired > 100


@pytest.mark.parametrize("case", ["forced", "decay"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forcing_rules_and_length_decay_hold_the_same_with_drafters(make_llm, case, temperature):
    """transformers' ``forced_bos_token_id`` (the one-token prompt's first token),
    ``forced_eos_token_id`` (the last token) and ``exponential_decay_length_penalty`` (the stop
    id's logit raised until it ends the output): the same output whatever drafts ran."""
    params = [
        SamplingParams(temperature=temperature, seed=s, max_tokens=30, ignore_eos=True)
        for s in range(len(PROMPTS))
    ]
    free = [o.token_ids for o in make_llm().generate(PROMPTS, params)]
    stop = free[1][6]
    if case == "forced":
        rules: dict = {"forced_bos_token_id": 9, "forced_eos_token_id": [free[0][5], 11]}
    else:
        rules = {"exponential_decay_length_penalty": (4, 1.8), "stop_token_ids": [stop]}
    outputs = same_with_drafters(make_llm, [replace(p, **rules) for p in params])
    if case == "decay":  # the stop id alone ends outputs too: the decay must end them sooner
        stopped = make_llm().generate(PROMPTS, [replace(p, stop_token_ids=[stop]) for p in params])
        free = [o.token_ids for o in stopped]
    assert outputs != free
    for prompt, out, alone in zip(PROMPTS, outputs, free):
        if case == "forced":
            assert len(out) == 30 and out[-1] in rules["forced_eos_token_id"]
            assert (out[0] == 9) == (len(prompt) == 1)
        else:
            assert len(out) <= len(alone) and out[-1] == stop and stop not in out[:-1]
