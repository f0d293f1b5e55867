"""Prompt lookup first, a drafter's model where lookup has nothing: ``SpecConfig(...,
lookup_first=n)``.

Summaries, edits and grounded answers copy runs of their prompt, and there prompt lookup's drafts
cost nothing to make, while a model drafter pays a forward per draft everywhere. This wrapper
asks prompt lookup first: when the sequence's last ``n`` or more tokens (up to 4) occurred
earlier in its prompt or output, it drafts what followed them (as ``prompt_lookup`` does);
otherwise the wrapped drafter drafts with its model. Each step every sequence gets one source,
so a step runs the model's forwards only for the sequences that need them.

The adaptive policy keeps acceptance per *draft class*: lookup classes are ``LOOKUP_CLASS + n``
(the matched n-gram's length), the wrapped drafter's keep their numbers, and ``runs_model`` tells
the policy which classes cost the model's forwards (drafters/policy.py), so a step whose drafts
all come from lookup is priced, and deepened, as prompt lookup's would be.

Output is untouched: whichever source drafts, the target verifies (specdec/verifier.py), and
a sampled request's drafts, lookup's included, are tested against the target's own race
winners, so seeded outputs stay those of plain decoding.
"""

from __future__ import annotations

from collections.abc import Callable

from specdec.drafters.base import Drafter, FinishedStep
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.sequence import Sequence

LOOKUP_CLASS = 1000  # lookup's draft classes: LOOKUP_CLASS + the matched n-gram's length
MAX_NGRAM = 4  # the longest suffix looked up
# What `specdec bench --drafters quantized_self+lookup` runs. Measured side by side (bfloat16,
# first turns of 5 questions per category, adaptive k <= 8), quantized_self with lookup_first
# 1 / 2 / 3 against quantized_self alone: summarization 1.40 / 1.50 / 1.40x against 1.32x,
# retrieval 1.46 / 1.42 / 1.47x against 1.27x, code editing 2.35 / 2.30 / 2.16x against 1.52x,
# chat 1.47x for all, short questions 1.32 / 1.49 / 1.46x against 1.49x: a 1-gram match is too
# often wrong where nothing is copied, so 2.
DEFAULT_LOOKUP_FIRST = 2
LOOKUP_SUFFIX = "+lookup"  # a bench drafter name with this suffix runs its base lookup-first


class LookupFirst:
    """``inner``'s drafts, except where the suffix ``min_n``-gram (or longer) occurred before."""

    def __init__(self, inner: Drafter, min_n: int):
        if not 1 <= min_n <= MAX_NGRAM:
            raise ValueError(f"lookup_first must be between 1 and {MAX_NGRAM}, got {min_n}")
        if inner.draft_forward is None:
            raise ValueError(
                f"lookup_first needs a drafter with a model of its own (quantized_self, "
                f"draft_model, eagle, medusa), not {inner.name!r}"
            )
        self.inner, self.lookup = inner, PromptLookupDrafter(min_n, MAX_NGRAM)
        self.name = f"{inner.name}+lookup"
        self.prior_acceptance = inner.prior_acceptance
        self.needs_token_hidden_states = inner.needs_token_hidden_states
        self.max_drafts = inner.max_drafts
        self.drafts_in_one_pass = inner.drafts_in_one_pass
        self.draft_forward: Callable[[int], object] | None = inner.draft_forward

    def draft_class(self, seq: Sequence) -> int:
        n = self.lookup.draft_class(seq)
        return LOOKUP_CLASS + n if n else self.inner.draft_class(seq)

    def runs_model(self, draft_class: int) -> bool:
        return draft_class < LOOKUP_CLASS

    def catch_up_tokens(self, seq: Sequence) -> int:
        return self.inner.catch_up_tokens(seq)

    def propose(self, seqs: list[Sequence], num_drafts: list[int], step: FinishedStep) -> None:
        looked_up = [bool(k) and self.lookup.draft_class(s) > 0 for s, k in zip(seqs, num_drafts)]
        # the model sees every sequence (a head queues each one's hidden states) but drafts
        # only for those lookup does not serve
        model_ks = [0 if hit else k for k, hit in zip(num_drafts, looked_up)]
        self.inner.propose(seqs, model_ks, step)
        hits = [(s, k) for s, k, hit in zip(seqs, num_drafts, looked_up) if hit]
        self.lookup.propose([s for s, _ in hits], [k for _, k in hits], step)

    def forget(self, seq: Sequence) -> None:
        self.inner.forget(seq)
        self.lookup.forget(seq)
