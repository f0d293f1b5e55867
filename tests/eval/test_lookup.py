"""The lookup ceiling and the 3-gram yardstick that specdec bench reports."""

from specdec.drafters.prompt_lookup import lookup
from specdec.eval.bench.lookup import lookup_ceiling, reference_lookup


def test_lookup_ceiling_counts_the_steps_of_an_oracle_lookup():
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    # Steps: (1, 2) -> [3, 4, 5] all pass + bonus 6 -> 4 tokens; (5, 6) -> [1, 2, 3]: 1 and 2
    # pass, 9 != 3 -> 3 tokens; (2, 9) occurred nowhere -> 1 token (7).
    output = [3, 4, 5, 6, 1, 2, 9, 7]
    assert lookup_ceiling(prompt, output, k=3, n=2) == (8, 3)
    assert lookup_ceiling(prompt, [], k=3, n=2) == (0, 0)


def test_the_oracle_picks_the_occurrence_the_output_follows():
    prompt = [1, 2, 7, 7, 1, 2, 8, 8, 1, 2]
    assert lookup(prompt, 2, 2, 2) == [8, 8]  # the drafter takes the latest occurrence...
    assert lookup_ceiling(prompt, [7, 7, 5], k=2, n=2) == (
        3,
        1,
    )  # ...the oracle the one that passes


def test_reference_lookup_drafts_k_after_every_3_gram_match():
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    # (7, 1, 2) occurred nowhere before: 3 comes alone; (1, 2, 3) -> [4, 5, 6, 7, 1, 2, 3]:
    # 4, 5, 6 pass, 9 != 7 -> 4 tokens; (5, 6, 9) occurred nowhere -> 1 token (8).
    assert reference_lookup(prompt, [3, 4, 5, 6, 9, 8], n=3, k=8) == (6, 3)
    # The last token is never a draft: it needs its own step, as in the engine.
    assert reference_lookup(prompt, [3, 4, 5], n=3, k=8) == (3, 2)
