"""specdec.verifier: the engine's front to verification, on hand-built steps."""

from __future__ import annotations

import torch

from specdec import verifier as verifier_module
from specdec.config import SamplingParams
from specdec.runner import StepResult
from specdec.scheduler import SchedulerOutput
from specdec.sequence import Sequence
from specdec.verifier import Verifier

VOCAB = 11


def make_step(
    specs: list[tuple[list[int], SamplingParams]],
    logits: torch.Tensor,
    prompt: tuple[int, ...] = (1, 2, 3),
) -> tuple[SchedulerOutput, StepResult]:
    """A decode step: each sequence feeds its last token plus its drafts, all of them sample."""
    seqs = []
    for i, (drafts, params) in enumerate(specs):
        seq = Sequence(i, list(prompt), len(prompt), params)
        seq.num_computed_tokens, seq.spec_token_ids = len(prompt) - 1, list(drafts)
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
    emitted = verifier.verify(*make_step(specs, logits)).emitted
    assert emitted == [[4, 5, 6], [8], [1, 2, 3]]  # 2 of 3 then the argmax; bonus after all
    stats = verifier.stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_verify_steps) == (5, 4, 2)
    assert stats.drafted_per_position == [2, 2, 1] and stats.accepted_per_position == [2, 2, 0]


def plain_tokens(params: SamplingParams, logits: torch.Tensor) -> list[int]:  # [n, V]
    """What plain decoding emits from row ``j`` of ``logits`` after ``3 + j`` tokens."""
    tokens = []
    for j, row in enumerate(logits):
        step = make_step([([], params)], row.unsqueeze(0), prompt=(1, 2, 3) + (0,) * j)
        tokens += Verifier().verify(*step).emitted[0]
    return tokens


def test_sampled_rows_emit_what_plain_decoding_emits() -> None:
    """Each row token is plain decoding's token at that position and seed, whatever the drafts
    and neighbours: accepted while drafts equal it, then the first mismatch or the bonus."""
    sampled = [SamplingParams(temperature=0.8, top_k=6, seed=s) for s in (1, 2, 3)]
    greedy = SamplingParams(temperature=0)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    plain = [plain_tokens(p, logits) for p in sampled]  # [3][4] tokens at positions 3..6
    wrong = [(t + 1) % VOCAB for t in plain[0]]
    specs = [
        ([plain[0][0], plain[0][1], wrong[2]], sampled[0]),  # 2 accepted, then recovered
        (plain[1][:3], sampled[1]),  # all 3 accepted, then the bonus
        ([], sampled[2]),  # no drafts: plain sampling
        ([(int(logits[0].argmax()) + 1) % VOCAB], greedy),  # rejected at once
    ]
    rows = [logits[: len(d) + 1] for d, _ in specs]
    verifier = Verifier()
    emitted = verifier.verify(*make_step(specs, torch.cat(rows))).emitted
    assert emitted == [plain[0][:3], plain[1][:4], plain[2][:1], [int(logits[0].argmax())]]
    assert (verifier.stats.num_draft_tokens, verifier.stats.num_accepted_tokens) == (7, 5)


def test_rows_after_a_mismatch_are_not_sampled(monkeypatch) -> None:
    sampled = SamplingParams(temperature=1.0, seed=5)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    first = plain_tokens(sampled, logits[:1])[0]
    num_rows: list[int] = []  # rows sampled by each call
    next_tokens = verifier_module.next_tokens

    def counting(logits: torch.Tensor, params: list, keys: list) -> list[int]:
        num_rows.append(len(keys))
        return next_tokens(logits, params, keys)

    monkeypatch.setattr(verifier_module, "next_tokens", counting)
    emitted = (
        Verifier().verify(*make_step([([(first + 1) % VOCAB, 0, 0], sampled)], logits)).emitted
    )
    assert emitted == [[first]] and num_rows == [1]


def test_a_row_is_unconstrained_only_when_constrain_rows_leaves_it_as_it_is():
    """``plain_greedy``'s shortcuts (draft_tokens', the heads') rest on this: whatever
    ``constrain_rows`` would change, the predicate must say so."""
    cases = {
        "plain": (SamplingParams(temperature=0, max_tokens=8), True),
        "bias": (SamplingParams(temperature=0, max_tokens=8, logit_bias={3: 5.0}), False),
        "penalty": (SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.2), False),
        "min_tokens": (SamplingParams(temperature=0, max_tokens=8, min_tokens=3), False),
    }
    for name, (params, expected) in cases.items():
        seq = Sequence(0, [5, 6, 7], 3, params, eos_token_ids=(2,))
        logits = torch.arange(12, dtype=torch.float32)[None] - 6  # token 2 (the EOS) at -4
        before = logits.clone()
        verifier_module.constrain_rows([seq], logits, [0])
        assert verifier_module.is_unconstrained(seq, 0) is expected, name
        assert torch.equal(logits, before) is expected, name
    seq = Sequence(0, [5, 6, 7], 3, cases["min_tokens"][0], eos_token_ids=(2,))
    assert verifier_module.is_unconstrained(seq, 3)  # past min_tokens with three drafts


def test_a_greedy_unconstrained_draft_is_the_argmax_and_a_biased_one_is_not():
    """``draft_tokens``' shortcut (every row greedy, nothing to constrain) gives the full rule's
    tokens; a row with a bias in the batch sends every row through the full rule."""
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    plain = SamplingParams(temperature=0, max_tokens=8)
    seqs = [Sequence(i, [5, 6, 7], 3, plain) for i in range(3)]
    assert verifier_module.draft_tokens(logits.clone(), seqs) == logits.argmax(-1).tolist()
    worst = int(logits[1].argmin())
    seqs[1] = Sequence(1, [5, 6, 7], 3, SamplingParams(temperature=0, max_tokens=8,
                                                        logit_bias={worst: 100.0}))  # fmt: skip
    tokens = verifier_module.draft_tokens(logits.clone(), seqs)
    assert tokens[1] == worst and tokens[0] == int(logits[0].argmax())


def test_greedy_rows_are_read_in_place_unless_a_row_is_constrained(monkeypatch) -> None:
    """A step whose rows are all greedy and unconstrained takes each row's argmax without the
    full rule (no copy of the rows); one constrained row (min_tokens against the EOS that tops
    its row) sends the step through the full rule, which must then keep the EOS out."""
    greedy, eos = SamplingParams(temperature=0, max_tokens=8), 2
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[3, eos] = 50.0  # the second sequence's first row: the EOS on top
    argmax = logits.argmax(-1).tolist()
    calls: list[int] = []
    next_tokens = verifier_module.next_tokens

    def counting(rows: torch.Tensor, params: list, keys: list) -> list[int]:
        calls.append(len(keys))
        return next_tokens(rows, params, keys)

    monkeypatch.setattr(verifier_module, "next_tokens", counting)

    def step(second: SamplingParams) -> tuple[SchedulerOutput, StepResult]:
        seqs = [Sequence(0, [1, 2, 3], 3, greedy, eos_token_ids=(eos,)),
                Sequence(1, [1, 2, 3], 3, second, eos_token_ids=(eos,))]  # fmt: skip
        seqs[0].spec_token_ids = [argmax[0], argmax[1]]  # both accepted, then the bonus
        seqs[1].spec_token_ids = [eos]
        for seq in seqs:
            seq.num_computed_tokens = 2
        hidden = torch.zeros(5, 4)
        return SchedulerOutput(seqs, [3, 2]), StepResult(logits, hidden, [0, 1], [3, 2])

    before = logits.clone()
    emitted = Verifier().verify(*step(greedy)).emitted
    assert emitted == [argmax[:3], [eos, argmax[4]]] and calls == []
    assert torch.equal(logits, before)  # read in place, left as it was
    emitted = Verifier().verify(*step(SamplingParams(temperature=0, max_tokens=8, min_tokens=4)))
    assert emitted.emitted[1] == [int(logits[3].topk(2).indices[1])]  # the EOS banned: rejected
    assert emitted.emitted[0] == argmax[:3] and calls and torch.equal(logits, before)
