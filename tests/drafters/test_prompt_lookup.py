from specdec.config import SamplingParams
from specdec.drafters.prompt_lookup import PromptLookupDrafter, lookup
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
