"""specdec.verifier: the engine's front to verification, on hand-built steps."""

from __future__ import annotations

import torch

from specdec.config import SamplingParams
from specdec.runner import StepResult
from specdec.sampling import process_logits_for
from specdec.scheduler import SchedulerOutput
from specdec.sequence import Sequence
from specdec.verifier import Verifier
from specdec.verify import rejection_sample

VOCAB = 11


def make_step(
    specs: list[tuple[list[int], SamplingParams]], logits: torch.Tensor
) -> tuple[SchedulerOutput, StepResult]:
    """A decode step: each sequence feeds its last token plus its drafts, all of them sample."""
    seqs = []
    for i, (drafts, params) in enumerate(specs):
        seq = Sequence(i, [1, 2, 3], 3, params)
        seq.num_computed_tokens, seq.spec_token_ids = 2, list(drafts)
        seqs.append(seq)
    rows = [len(d) + 1 for d, _ in specs]
    out = SchedulerOutput(seqs, rows)
    hidden = torch.zeros(sum(rows), 4)
    return out, StepResult(logits, hidden, list(range(len(seqs))), rows)


def test_greedy_rows_accept_the_prefix_that_matches_the_argmax() -> None:
    greedy = SamplingParams(temperature=0)
    argmax = [[4, 5, 6, 7], [8], [1, 2, 3]]  # per sequence: argmax at each of its rows
    specs = [([4, 5, 9], greedy), ([], greedy), ([1, 2], greedy)]
    logits = torch.full((8, VOCAB), -1.0)
    for row, token in enumerate(t for seq_rows in argmax for t in seq_rows):
        logits[row, token] = 5.0
    verifier = Verifier()
    emitted = verifier.verify(*make_step(specs, logits))
    assert emitted == [[4, 5, 6], [8], [1, 2, 3]]  # 2 of 3 then the argmax; bonus after all
    stats = verifier.stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_verify_steps) == (5, 4, 2)
    assert stats.drafted_per_position == [2, 2, 1] and stats.accepted_per_position == [2, 2, 0]


def test_mixed_batch_matches_rejection_sampling_of_the_whole_batch() -> None:
    """Greedy rows take the fast path; sampled rows must still get exactly what the reference
    rejection sampler gives them (same seeds), so splitting the batch changes nothing."""
    torch.manual_seed(0)
    sampled = [SamplingParams(temperature=0.8, top_k=6, seed=s) for s in (1, 2)]
    greedy = SamplingParams(temperature=0)
    specs = [([3, 4], sampled[0]), ([5, 6, 7], greedy), ([], sampled[1]), ([2], greedy)]
    logits = torch.randn(10, VOCAB) * 3
    emitted = Verifier().verify(*make_step(specs, logits))

    params = [p for d, p in specs for _ in range(len(d) + 1)]
    target = logits.clone()
    for row, p in enumerate(params):
        if not p.is_greedy:
            target[row] = process_logits_for(logits[row : row + 1], [p])[0]
    expected = rejection_sample(
        torch.tensor([t for d, _ in specs for t in d]),
        torch.tensor([len(d) for d, _ in specs]).cumsum(0),
        None,
        target,
        torch.tensor([p.is_greedy for _, p in specs]),
        [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for _, p in specs],
    )
    counts = expected.num_emitted_tokens.tolist()
    assert emitted == [row[:n] for row, n in zip(expected.output_token_ids.tolist(), counts)]
