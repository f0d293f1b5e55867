"""The lookup ceiling reported by the speculation benchmark."""

from specdec import SpecConfig
from specdec.eval.bench_spec import lookup_ceiling


def test_lookup_ceiling_counts_steps_of_a_drafter_that_always_drafts_k():
    spec = SpecConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    # Steps: lookup [3, 4, 5] all pass + bonus 6 -> 4 tokens; then suffix (5, 6) proposes
    # [1, 2, 3]: 1 and 2 pass, 9 != 3 -> 3 tokens; then (2, 9) has no match -> 1 token (7).
    output = [3, 4, 5, 6, 1, 2, 9, 7]
    assert lookup_ceiling(prompt, output, spec) == (8, 3)
    assert lookup_ceiling(prompt, [], spec) == (0, 0)
