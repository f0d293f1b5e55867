"""The verification front: from a step's logits to the tokens each sequence emits.

Plain sampling is verification with no drafts: a sequence with ``k`` drafts gets ``k + 1`` logit
rows; its drafts are accepted or rejected against the target distribution and one more token
(recovered at the first rejection, or the bonus token after all accepted) is drawn. Every row's
distribution comes from :func:`specdec.sampling.process_logits`, the same function whether or not
a sequence speculates, so speculation cannot change what is sampled.
"""

from __future__ import annotations

import torch

from specdec.runner import StepResult
from specdec.sampling import process_logits, sample
from specdec.scheduler import SchedulerOutput


class Verifier:
    def verify(self, out: SchedulerOutput, res: StepResult) -> list[list[int]]:
        """Return, for every scheduled sequence, the tokens it emits this step (maybe none)."""
        emitted: list[list[int]] = [[] for _ in out.seqs]
        if not res.sample_indices:
            return emitted
        seqs = [out.seqs[i] for i in res.sample_indices]
        if any(n > 1 for n in res.num_logit_rows):
            raise NotImplementedError("draft verification is not wired in yet")
        tokens = self._sample(seqs, res.logits)
        for i, token in zip(res.sample_indices, tokens):
            emitted[i] = [token]
        return emitted

    def _sample(self, seqs: list, logits: torch.Tensor) -> list[int]:  # logits [S, V]
        """One token per sequence: argmax for greedy rows, the processed distribution otherwise."""
        tokens = logits.argmax(dim=-1)  # [S]
        random_rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            params = [seqs[i].params for i in random_rows]
            probs = process_logits(
                logits[rows],
                torch.tensor([p.temperature for p in params]),
                torch.tensor([p.top_k for p in params]),
                torch.tensor([p.top_p for p in params]),
                torch.tensor([p.min_p for p in params]),
            )
            tokens[rows] = sample(probs, [seqs[i].generator for i in random_rows])
        return tokens.tolist()
