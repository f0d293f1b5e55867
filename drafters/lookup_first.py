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
all come from lookup is priced, and deepened, as prompt lookup's would be. Where a sequence's
suffix matched, the source is the one the policy values more for it (:meth:`AdaptivePolicy.value`:
expected tokens per second at the best depth, from the acceptance measured so far and the cost
curves): a short match in a chat, accepted half the time, loses to a quantized copy accepted
nine times in ten even at the price of its forwards, while a long copied run wins.

Output is untouched: whichever source drafts, the target verifies (specdec/verifier.py), and
a sampled request's drafts, lookup's included, are tested against the target's own race
winners, so seeded outputs stay those of plain decoding.
"""

from __future__ import annotations

from collections.abc import Callable

from specdec.drafters.base import Drafter, FinishedStep
from specdec.drafters.policy import AdaptivePolicy
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.sequence import Sequence

LOOKUP_CLASS = 1000  # lookup's draft classes: LOOKUP_CLASS + the matched n-gram's length
MAX_NGRAM = 4  # the longest suffix looked up
# Acceptance assumed for a lookup draft before the policy has measured its class, by matched
# n-gram length: prompt lookup's first drafts were accepted 16-31% of the time after a 1-gram
# match and 80-100% after a 4-gram one on our prompt sets (drafters/prompt_lookup.py). Optimistic
# enough that a long match is tried, and so measured, beside a model accepted 0.9 of the time.
LOOKUP_PRIORS = {1: 0.3, 2: 0.5, 3: 0.7, 4: 0.85}
# What `specdec bench --drafters quantized_self+lookup` runs. Measured side by side in float32
# (first turns of 5 questions per category; lookup_first 2 / 3 against quantized_self alone):
# code editing 2.15 / 2.35x against 1.85x, summarization 1.46 / 1.55x against 1.45x, retrieval
# 1.41 / 1.37x against 1.33x, chat 2.16 / 2.11x against 2.24x; in bfloat16 before the policy
# chose between the sources, a 1-gram match (lookup_first=1) cost short questions 1.32x against
# 1.49x. 2 and 3 are within the noise of each other; 2 drafts by lookup more often.
DEFAULT_LOOKUP_FIRST = 2
LOOKUP_SUFFIX = "+lookup"  # a bench drafter name with this suffix runs its base lookup-first


class LookupFirst:
    """``inner``'s drafts, except where the suffix ``min_n``-gram (or longer) occurred before."""

    def __init__(self, inner: Drafter, min_n: int):
        if inner.draft_forward is None:
            raise ValueError(
                f"lookup_first needs a drafter with a model of its own (quantized_self, "
                f"draft_model, eagle, medusa), not {inner.name!r}"
            )
        self.inner, self.lookup = inner, PromptLookupDrafter(min_n, MAX_NGRAM)
        self.name = f"{inner.name}+lookup"
        self.prior_acceptance = inner.prior_acceptance
        self.needs_token_hidden_states = inner.needs_token_hidden_states
        self.adapter_model = getattr(inner, "adapter_model", None)  # its model runs the adapters
        self.max_drafts = inner.max_drafts
        self.drafts_in_one_pass = inner.drafts_in_one_pass
        self.draft_forward: Callable[[int], object] | None = inner.draft_forward
        # the engine's policy, whose estimates choose the source (set by build_speculation)
        self.policy: AdaptivePolicy | None = None
        self._chosen: dict[int, tuple[int, int]] = {}  # seq_id -> (num_tokens, chosen class)
        self.class_priors = {LOOKUP_CLASS + n: a for n, a in LOOKUP_PRIORS.items()}

    def draft_class(self, seq: Sequence) -> int:
        """Lookup's class where the suffix matched and lookup is worth more than the model
        there, as the adaptive policy prices the two (acceptance so far, the model's forwards;
        with a fixed k, wherever it matched); else the model's class. Kept for
        :meth:`propose`."""
        n = self.lookup.draft_class(seq)
        chosen = self.inner.draft_class(seq)
        if n:
            looked_up = LOOKUP_CLASS + n
            policy = self.policy
            if (
                not chosen
                or policy is None
                or policy.cost is None  # a fixed k: lookup wherever it matched
                or policy.value(seq, looked_up, False) >= policy.value(seq, chosen, True)
            ):
                chosen = looked_up
        self._chosen[seq.seq_id] = (seq.num_tokens, chosen)
        return chosen

    def runs_model(self, draft_class: int) -> bool:
        return draft_class < LOOKUP_CLASS

    def catch_up_tokens(self, seq: Sequence) -> int:
        return self.inner.catch_up_tokens(seq)

    def propose(self, seqs: list[Sequence], num_drafts: list[int], step: FinishedStep) -> None:
        looked_up = [bool(k) and self._source(s) >= LOOKUP_CLASS for s, k in zip(seqs, num_drafts)]
        # the model sees every sequence (a head queues each one's hidden states) but drafts
        # only for those lookup does not serve
        model_ks = [0 if hit else k for k, hit in zip(num_drafts, looked_up)]
        self.inner.propose(seqs, model_ks, step)
        hits = [(s, k) for s, k, hit in zip(seqs, num_drafts, looked_up) if hit]
        self.lookup.propose([s for s, _ in hits], [k for _, k in hits], step)

    def forget(self, seq: Sequence) -> None:
        self.inner.forget(seq)
        self.lookup.forget(seq)
        self._chosen.pop(seq.seq_id, None)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        copy = getattr(self.inner, "copy_blocks", None)
        if copy is not None:
            copy(copies)

    def _source(self, seq: Sequence) -> int:
        """The class :meth:`draft_class` chose for ``seq`` as it is now (chosen again if not)."""
        cached = self._chosen.get(seq.seq_id)
        return cached[1] if cached and cached[0] == seq.num_tokens else self.draft_class(seq)
