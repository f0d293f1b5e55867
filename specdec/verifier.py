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
from specdec.verify import VerifyOutput, rejection_sample


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

    def record(self, num_drafts: list[int], result: VerifyOutput) -> None:
        accepted = result.accepted_mask.long()  # [B, max_k]
        max_k = accepted.shape[1]
        for stats in (self.accepted_per_position, self.drafted_per_position):
            stats.extend([0] * (max_k - len(stats)))
        for j, count in enumerate(accepted.sum(dim=0).tolist()):
            self.accepted_per_position[j] += count
        for k in num_drafts:
            for j in range(k):
                self.drafted_per_position[j] += 1
        self.num_verify_steps += sum(1 for k in num_drafts if k)
        self.num_draft_tokens += sum(num_drafts)
        self.num_accepted_tokens += int(result.num_accepted.sum())


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
        row_seqs = [s for s, n in zip(seqs, res.num_logit_rows) for _ in range(n)]  # [T + B]
        target = res.logits.clone()  # [T + B, V]
        random_rows = [i for i, s in enumerate(row_seqs) if not s.params.is_greedy]
        if random_rows:
            target[random_rows] = process_logits_for(
                res.logits[random_rows], [row_seqs[i].params for i in random_rows]
            )
        draft_ids = torch.tensor([t for s in seqs for t in s.spec_token_ids], dtype=torch.long)
        cu = torch.tensor(num_drafts, dtype=torch.long).cumsum(0)
        draft_probs = self.drafter.draft_probs(seqs) if self.drafter is not None else None
        result = rejection_sample(
            draft_ids,
            cu,
            draft_probs,
            target,
            torch.tensor([s.params.is_greedy for s in seqs]),
            [s.generator for s in seqs],
        )
        self.stats.record(num_drafts, result)
        counts = result.num_emitted_tokens.tolist()
        return [row[:n] for row, n in zip(result.output_token_ids.tolist(), counts)]
