"""The verification front: from a step's logits to the tokens each sequence emits.

Plain sampling is verification with no drafts. A sequence with ``k`` drafts gets ``k + 1`` logit
rows (one per draft position, then its bonus position); :func:`specdec.verify.rejection_sample`
accepts or rejects its drafts against the target distribution and draws one more token
(recovered at the first rejection, or the bonus token after all accepted). Every random row's
distribution comes from :func:`specdec.sampling.process_logits`, the same function whether or not
a sequence speculates, so speculation cannot change what is sampled. Greedy rows keep their raw
logits: only their argmax is read, exactly as plain greedy decoding reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.runner import StepResult
from specdec.sampling import process_logits_for, sample
from specdec.scheduler import SchedulerOutput
from specdec.sequence import Sequence
from specdec.verify import rejection_sample


@dataclass(slots=True)
class SpecStats:
    """Speculation counters aggregated over an engine's lifetime.

    A *verify step* is one sequence verifying at least one draft in one engine step; its
    *accepted length* counts the accepted drafts plus the one token verification always adds.
    """

    num_verify_steps: int = 0  # (sequence, step) pairs that verified >= 1 draft
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [k] accepted at position j
    drafted_per_position: list[int] = field(default_factory=list)  # [k] verified at position j

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float:
        return (self.num_accepted_tokens + self.num_verify_steps) / max(1, self.num_verify_steps)

    @property
    def acceptance_per_position(self) -> list[float]:
        return [
            a / max(1, d) for a, d in zip(self.accepted_per_position, self.drafted_per_position)
        ]

    def record(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        """Count one step's verification: sequence ``i`` accepted ``num_accepted[i]`` of its
        ``num_drafts[i]`` drafts (an accepted prefix)."""
        width = max(num_drafts, default=0)
        for stats in (self.accepted_per_position, self.drafted_per_position):
            stats.extend([0] * (width - len(stats)))
        for k, m in zip(num_drafts, num_accepted):
            for j in range(k):
                self.drafted_per_position[j] += 1
                self.accepted_per_position[j] += j < m
        self.num_verify_steps += sum(1 for k in num_drafts if k)
        self.num_draft_tokens += sum(num_drafts)
        self.num_accepted_tokens += sum(num_accepted)


class Verifier:
    def __init__(self, drafter=None):  # noqa: ANN001 - a Drafter, or None without speculation
        self.drafter = drafter
        self.stats = SpecStats()

    def verify(self, out: SchedulerOutput, res: StepResult) -> list[list[int]]:
        """Return, for every scheduled sequence, the tokens it emits this step (maybe none)."""
        emitted: list[list[int]] = [[] for _ in out.seqs]
        seqs = [out.seqs[i] for i in res.sample_indices]
        if not seqs:
            return emitted
        if all(n == 1 for n in res.num_logit_rows):
            tokens = [[t] for t in self._sample(seqs, res.logits)]
        else:
            tokens = self._verify_drafts(seqs, res)
        for i, seq_tokens in zip(res.sample_indices, tokens):
            emitted[i] = seq_tokens
        return emitted

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:  # [S, V]
        """One token per sequence: argmax for greedy rows, the processed distribution otherwise."""
        tokens = logits.argmax(dim=-1)  # [S]
        random_rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if random_rows:
            probs = process_logits_for(logits[random_rows], [seqs[i].params for i in random_rows])
            tokens[random_rows] = sample(probs, [seqs[i].generator for i in random_rows])
        return tokens.tolist()

    def _verify_drafts(self, seqs: list[Sequence], res: StepResult) -> list[list[int]]:
        num_drafts = [n - 1 for n in res.num_logit_rows]
        starts = [0]  # first logit row of each sequence
        for n in res.num_logit_rows:
            starts.append(starts[-1] + n)
        tokens: list[list[int]] = [[] for _ in seqs]
        num_accepted = [0] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.params.is_greedy]
        if greedy:
            logits = res.logits  # every row greedy: no gather
            if len(greedy) < len(seqs):
                logits = logits[[r for i in greedy for r in range(starts[i], starts[i + 1])]]
            argmax = logits.argmax(dim=-1).tolist()  # one per greedy row, in order
            offset = 0
            for i in greedy:
                n = starts[i + 1] - starts[i]
                tokens[i] = _accept_greedy(seqs[i].spec_token_ids, argmax[offset : offset + n])
                num_accepted[i] = len(tokens[i]) - 1
                offset += n
        sampled = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if sampled:
            for i, seq_tokens in zip(sampled, self._rejection_sample(seqs, res, sampled, starts)):
                tokens[i] = seq_tokens
                num_accepted[i] = len(seq_tokens) - 1
        self.stats.record(num_drafts, num_accepted)
        return tokens

    def _rejection_sample(
        self, seqs: list[Sequence], res: StepResult, sampled: list[int], starts: list[int]
    ) -> list[list[int]]:
        """Exact rejection sampling (specdec/verify.py) for the sampled sequences ``sampled``."""
        chosen = [seqs[i] for i in sampled]
        rows = [r for i in sampled for r in range(starts[i], starts[i + 1])]
        row_params = [seqs[i].params for i in sampled for _ in range(starts[i], starts[i + 1])]
        target = process_logits_for(res.logits[rows], row_params)  # [T + B, V]
        draft_ids = torch.tensor([t for s in chosen for t in s.spec_token_ids], dtype=torch.long)
        cu = torch.tensor([len(s.spec_token_ids) for s in chosen], dtype=torch.long).cumsum(0)
        draft_probs = self.drafter.draft_probs(chosen) if self.drafter is not None else None
        result = rejection_sample(
            draft_ids,
            cu,
            draft_probs,
            target,
            torch.zeros(len(chosen), dtype=torch.bool),
            [s.generator for s in chosen],
        )
        counts = result.num_emitted_tokens.tolist()
        return [row[:n] for row, n in zip(result.output_token_ids.tolist(), counts)]


def _accept_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
    """Greedy verification: keep drafts while each equals the target's argmax at its position,
    then add the argmax at the first mismatch (or the bonus position). This is what rejection
    sampling does when p is one-hot (kernels/rejection.py treats greedy rows the same way)."""
    m = 0
    while m < len(drafts) and drafts[m] == argmax[m]:
        m += 1
    return drafts[:m] + [argmax[m]]
