import random

from specdec.config import SamplingParams
from specdec.drafters.prompt_lookup import PromptLookupDrafter, find_match, lookup
from specdec.sequence import Sequence


def test_longest_suffix_match_proposes_what_followed():
    tokens = [5, 1, 2, 3, 9, 9, 4, 1, 2, 3]
    assert lookup(tokens, k=3, min_n=1, max_n=3) == [9, 9, 4]


def test_most_recent_match_with_a_full_continuation_wins():
    tokens = [1, 2, 7, 7, 1, 2, 8, 8, 8, 1, 2]
    assert lookup(tokens, k=2, min_n=2, max_n=2) == [8, 8]
    # Only the earliest match has k tokens after it.
    assert lookup([1, 2, 7, 7, 7, 1, 2, 8, 1, 2], k=4, min_n=2, max_n=2) == [7, 7, 7, 1]


def test_no_match_or_too_short_history_proposes_nothing():
    assert lookup([1, 2, 3, 4], k=4, min_n=2, max_n=3) == []
    assert lookup([1], k=4, min_n=1, max_n=3) == []
    assert lookup([1, 2, 3, 4, 5, 1], k=4, min_n=2, max_n=3) == []  # min_n not reached


def test_falls_back_to_shorter_n_grams():
    tokens = [4, 3, 6, 0, 3]
    assert lookup(tokens, k=2, min_n=1, max_n=3) == [6, 0]


def test_draft_class_is_the_matched_n_gram_and_propose_reuses_the_search():
    drafter = PromptLookupDrafter(min_n=1, max_n=3)
    seqs = [
        Sequence(0, [5, 1, 2, 3, 9, 9, 4, 1, 2, 3], 10, SamplingParams()),
        Sequence(1, [4, 3, 6, 0, 3], 5, SamplingParams()),
        Sequence(2, [1, 2, 3, 4], 4, SamplingParams()),
    ]
    assert [drafter.draft_class(s) for s in seqs] == [3, 1, 0]
    drafter.propose(seqs, [3, 2, 4])
    assert [s.spec_token_ids for s in seqs] == [[9, 9, 4], [6, 0], []]
    seqs[1].token_ids += [6, 0]  # the sequence moved on: a new search, not the cached one
    assert drafter.draft_class(seqs[1]) == 3


def brute_force_match(tokens, min_n, max_n):
    """Every n from max_n down: the starts of earlier occurrences of the suffix n-gram."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if starts:
            return n, starts
    return 0, []


def test_find_match_agrees_with_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        n, starts = find_match(tokens, min_n, max_n)
        assert (n, starts.tolist()) == brute_force_match(tokens, min_n, max_n), tokens


def test_history_array_follows_the_sequence():
    drafter = PromptLookupDrafter(min_n=1, max_n=3)
    seq = Sequence(0, [1, 2, 3], 3, SamplingParams())
    for step in range(40):  # grown step by step, past its first capacity
        assert drafter._tokens(seq).tolist() == seq.token_ids
        seq.token_ids += [step % 5] * (step % 3)
    seq.token_ids[-1] += 1  # not an extension of what it saw: rebuilt from the list
    assert drafter._tokens(seq).tolist() == seq.token_ids
    drafter.forget(seq)
    assert seq.seq_id not in drafter._history
