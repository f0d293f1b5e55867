"""The verification front: from a step's logits to the tokens each sequence emits.

A sequence with ``k`` drafts gets ``k + 1`` logit rows: one per draft position, then its bonus
position. Plain sampling is the case ``k = 0``, through the same code and the same noise.

Terms:
    row token: the token plain decoding would emit at a row, given the tokens before it
        (:func:`specdec.sampling.next_tokens`): the argmax of the raw logits for a greedy request;
        for a sampled one, the winner of the exponential race over the row's ``process_logits``
        distribution ``p``, with the noise keyed by the request's seed and the row's position.
    accepted draft: a draft equal to its row's token (and every draft before it accepted).
    recovered token: the row token at the first draft that differs from it; the sequence stops.
    bonus token: the row token after the last draft, when all ``k`` drafts were accepted.

A sequence emits its row tokens up to and including the first mismatch, or up to its bonus token:
the tokens plain decoding with the same seed emits at those positions, whatever was drafted (bit
for bit when the logits are, see ``EngineConfig.batch_invariant``). So a seeded request's output
depends on neither the drafter, nor the draft depth, nor the batch.

Why this is exact rejection sampling (Leviathan et al. 2023; Chen et al. 2023). A deterministic
drafter (prompt lookup, a greedy draft model) fixes the draft ``d`` of a position from the tokens
before it, independently of that position's noise, so the row token ``X`` follows ``p`` and:
the draft is accepted with probability ``P(X = d) = p(d)``, which is ``min(1, p(d) / q(d))`` for
the one-hot ``q`` at ``d``; after a rejection, ``X`` given ``X != d`` follows ``p`` without ``d``,
renormalised, which is ``norm(max(0, p - q))``, the recovered distribution; and the bonus token
is ``X ~ p``. A drafter with randomness of its own is the same case given that randomness. A
drafter that samples with the same keyed noise (drafters/draft_model.py) only changes how often
drafts are accepted; what is emitted is still the row tokens. The general ``min(1, p / q)`` rule
stays in :func:`specdec.verify.rejection_sample`, which the engine does not call.

Two backends compute the same thing. ``"torch"`` (the CPU's) walks one draft position at a time
across the batch and never samples a row after a mismatch: on the CPU, drawing a sampled row's
noise costs far more than comparing its token. ``"triton"`` (CUDA's) draws every row's noise on
the device and hands the whole step to one launch of the fused kernel in row-token mode
(:func:`specdec.kernels.rejection.verify_row_tokens_triton`), greedy and sampled rows together.
Fed the same noise, both emit the same tokens (``tests/test_device.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from specdec.kernels.rejection import verify_row_tokens_triton
from specdec.outputs import TokenLogprobs
from specdec.runner import StepResult
from specdec.sampling import (
    exponential_noise,
    next_tokens,
    process_logits_for,
    row_argmax,
    token_logprobs,
)
from specdec.scheduler import SchedulerOutput
from specdec.sequence import Sequence
from specdec.token_rules import (
    apply_logits_processors,
    apply_penalties,
    apply_position_rules,
    decays_length,
    forced_tokens,
    generate_rule_bans,
    sequence_bias_row,
    word_ends,
)
from specdec.verify import BACKENDS


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

    def record(self, seqs: list[Sequence], num_drafts: list[int], num_accepted: list[int]) -> None:
        """Count one step's verification, for the engine and for each sequence's metrics (the
        only place acceptance is counted): ``seqs[i]`` accepted ``num_accepted[i]`` of its
        ``num_drafts[i]`` drafts (an accepted prefix)."""
        width = max(num_drafts, default=0)
        for stats in (self.accepted_per_position, self.drafted_per_position):
            stats.extend([0] * (width - len(stats)))
        for seq, k, m in zip(seqs, num_drafts, num_accepted):
            seq.metrics.num_draft_tokens += k
            seq.metrics.num_accepted_tokens += m
            for j in range(k):
                self.drafted_per_position[j] += 1
                self.accepted_per_position[j] += j < m
        self.num_verify_steps += sum(1 for k in num_drafts if k)
        self.num_draft_tokens += sum(num_drafts)
        self.num_accepted_tokens += sum(num_accepted)


@dataclass(slots=True)
class Verification:
    """What one step's verification decided, per scheduled sequence in batch order."""

    emitted: list[list[int]]  # [B] tokens each emits this step: accepted drafts, then one more
    num_drafts: list[int]  # [B] drafts each verified (0 for a prefill chunk or a plain decode)
    # [B] raw logits of the rows the emitted tokens came from, [len(emitted[i]), V], for the
    # sequences whose params ask for them (return_logits); None for the others
    logits: list[torch.Tensor | None] = field(default_factory=list)
    # [B] the emitted tokens' log-probabilities, for the sequences whose params ask for them
    # (SamplingParams.logprobs); None for the others
    logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)

    @property
    def num_accepted(self) -> list[int]:  # [B] drafts each accepted
        return [max(0, len(tokens) - 1) for tokens in self.emitted]


class Verifier:
    def __init__(self, backend: str = "torch") -> None:
        """``backend``: ``"torch"``, the walk; ``"triton"``, one kernel launch per step."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown verification backend {backend!r}; choose one of {BACKENDS}")
        self.backend = backend
        self.stats = SpecStats()

    def verify(self, out: SchedulerOutput, res: StepResult) -> Verification:
        """Decide, for every scheduled sequence, the tokens it emits this step (maybe none),
        and count the drafts verified and accepted."""
        num_seqs = len(out.seqs)
        verification = Verification(
            [[] for _ in out.seqs], [0] * num_seqs, [None] * num_seqs, [None] * num_seqs
        )
        seqs = [out.seqs[i] for i in res.sample_indices]
        verify = self._walk if self.backend == "torch" else self._one_launch
        tokens = verify(seqs, res.logits, res.num_logit_rows)
        first_row = 0
        for i, seq_tokens, num_rows in zip(res.sample_indices, tokens, res.num_logit_rows):
            verification.emitted[i], verification.num_drafts[i] = seq_tokens, num_rows - 1
            params = out.seqs[i].params
            rows = res.logits[first_row : first_row + len(seq_tokens)]  # the raw logits
            if params.return_logits:  # a copy: the step's logits are let go
                verification.logits[i] = rows.clone()
            if params.logprobs is not None:
                verification.logprobs[i] = token_logprobs(rows, seq_tokens, params.logprobs)
            first_row += num_rows
        num_drafts = [n - 1 for n in res.num_logit_rows]
        self.stats.record(seqs, num_drafts, [len(t) - 1 for t in tokens])
        return verification

    def _walk(
        self,
        seqs: list[Sequence],  # [S]
        logits: torch.Tensor,  # [M, V] per sequence its draft rows, then its bonus row
        num_rows: list[int],  # [S] rows of each sequence (its drafts + 1)
    ) -> list[list[int]]:
        """Each sequence's accepted drafts, then its recovered or bonus token."""
        starts = [0, *itertools.accumulate(num_rows)]  # first row of each sequence
        tokens: list[list[int]] = [[] for _ in seqs]
        live = list(range(len(seqs)))  # sequences whose drafts so far were all accepted
        # Greedy rows that nothing constrains (at position 0, so at every later one: of the
        # rules that depend on the position, min_tokens only ever lifts and begin_suppress_tokens
        # holds at 0 alone; the forcing rules and length decay are left to the row-by-row walk)
        # take the argmax of their raw rows: all rows at once, in place, instead of a copy of
        # each position's rows (38 us a row of the default model).
        argmax = None
        if all(
            seq.params.is_greedy and is_unconstrained(seq, 0) and not seq.params.has_position_rules
            for seq in seqs
        ):
            argmax = row_argmax(logits).tolist()
        j = 0  # draft position
        while live:
            rows = [starts[i] + j for i in live]
            row_tokens = (
                [argmax[r] for r in rows]
                if argmax is not None
                else self._row_tokens([seqs[i] for i in live], logits[rows], j)
            )
            for i, token in zip(live, row_tokens):
                tokens[i].append(token)
            live = [
                i
                for i, token in zip(live, row_tokens)
                if j + 1 < num_rows[i] and seqs[i].spec_token_ids[j] == token
            ]
            j += 1
        return tokens

    def _one_launch(
        self,
        seqs: list[Sequence],  # [S]
        logits: torch.Tensor,  # [M, V] per sequence its draft rows, then its bonus row
        num_rows: list[int],  # [S] rows of each sequence (its drafts + 1)
    ) -> list[list[int]]:
        """:meth:`_walk`'s tokens from every row at once: processed probabilities and keyed
        noise for the sampled rows, raw logits for the greedy ones, one kernel launch."""
        if not seqs:
            return []
        device = logits.device
        row_seqs = [seq for seq, n in zip(seqs, num_rows) for _ in range(n)]  # [M]
        row_j = [j for n in num_rows for j in range(n)]  # [M] draft position of each row
        rows = logits.clone()  # the step's raw logits stay as they are, for return_logits
        constrain_rows(row_seqs, rows, row_j)
        sampled = [r for r, seq in enumerate(row_seqs) if not seq.params.is_greedy]
        noise = torch.ones_like(logits)  # greedy rows read no noise
        if sampled:
            index = torch.tensor(sampled, device=device)
            rows[index] = process_logits_for(rows[index], [row_seqs[r].params for r in sampled])
            keys = [(row_seqs[r].seed, row_seqs[r].num_tokens + row_j[r]) for r in sampled]
            noise[index] = exponential_noise(keys, logits.shape[1], device)
        drafts = [t for seq, n in zip(seqs, num_rows) for t in seq.spec_token_ids[: n - 1]]
        host = torch.tensor(
            [*drafts, *itertools.accumulate(n - 1 for n in num_rows)], dtype=torch.int64
        ).to(device, non_blocking=True)
        greedy = torch.tensor([seq.params.is_greedy for seq in seqs]).to(device, non_blocking=True)
        output, num_accepted = verify_row_tokens_triton(
            host[: len(drafts)], host[len(drafts) :], rows, greedy, noise,
            max(num_rows) - 1,
        )  # fmt: skip
        counts = num_accepted.tolist()
        return [row[: m + 1] for row, m in zip(output.tolist(), counts)]

    def _row_tokens(
        self,
        seqs: list[Sequence],  # [L]
        logits: torch.Tensor,  # [L, V] each sequence's row at draft position j
        j: int,
    ) -> list[int]:
        """The row token of each sequence at draft position ``j`` (its bonus row when ``j == k``):
        the token at position ``num_tokens + j`` of its token ids."""
        keys = [(seq.seed, seq.num_tokens + j) for seq in seqs]
        constrain_rows(seqs, logits, [j] * len(seqs))
        return next_tokens(logits, [seq.params for seq in seqs], keys)


@torch.inference_mode()  # a draft runner's logits are inference tensors
def draft_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Each sequence's next draft, after the drafts it has so far, from a drafter's raw logits
    [len(seqs), V] (changed in place): the target's rule (:func:`next_tokens`, keyed by the
    drafted position) on logits constrained as the target's row there will be
    (:func:`constrain_rows`: bias, ``min_tokens``, penalties, a guide), so that a draft the guide
    forbids is never proposed, only to be rejected. Where :func:`plain_greedy` holds, that rule
    is the argmax of the raw logits, taken at once."""
    if plain_greedy(seqs):
        return row_argmax(logits).tolist()
    positions = [len(seq.spec_token_ids) for seq in seqs]
    constrain_rows(seqs, logits, positions)
    dead = ~torch.isfinite(logits).any(dim=1)  # a reduced draft vocabulary the guide excludes:
    if dead.any():  # any draft then, which the target will reject
        logits[dead] = 0.0
    keys = [(seq.seed, seq.num_tokens + j) for seq, j in zip(seqs, positions)]
    return next_tokens(logits, [seq.params for seq in seqs], keys)


def plain_greedy(seqs: list[Sequence]) -> bool:
    """Whether every sequence's next draft is the argmax of its raw logits: greedy, and
    :func:`is_unconstrained` at the draft position it is at."""
    return all(s.params.is_greedy and is_unconstrained(s, len(s.spec_token_ids)) for s in seqs)


def is_unconstrained(seq: Sequence, j: int) -> bool:
    """Whether :func:`constrain_rows` leaves ``seq``'s row at draft position ``j`` as it is: no
    bias, no penalties, no guide, ``min_tokens`` reached. Keep the two in step."""
    params = seq.params
    return (
        not params.logit_bias
        and seq.allowed_ids is None
        and not seq.bad_word_ids
        and not params.has_generate_rules
        and not params.sequence_bias
        and not (params.begin_suppress_tokens and seq.num_output_tokens + j == 0)
        and forced_tokens(params, seq.num_output_tokens + j, seq.num_prompt_tokens) is None
        and not decays_length(params, seq.num_output_tokens + j)
        and seq.num_output_tokens + j >= params.min_tokens
        and not params.has_penalties
        and seq.guide is None
        and not params.logits_processors
    )


def ending_ids(seq: Sequence) -> list[int]:
    """The token ids that end ``seq``: its ``stop_token_ids`` and, unless ``ignore_eos``, its
    end-of-sequence ids (what ``min_tokens`` forbids and the length decay raises)."""
    eos = () if seq.params.ignore_eos else seq.eos_token_ids
    return [*seq.params.stop_token_ids, *eos]


def banned_word_ends(seq: Sequence, j: int) -> list[int]:
    """The last tokens of ``seq``'s bad words whose other tokens end its output and first ``j``
    drafts (a one-token word is always banned), as vLLM's ``bad_words`` rule."""
    longest = max(len(ids) for ids in seq.bad_word_ids) - 1
    start = max(seq.num_prompt_tokens, seq.num_tokens - longest)
    tail = seq.token_ids[start:] + seq.spec_token_ids[:j]  # the output's last tokens
    return word_ends(seq.bad_word_ids, tail)


def keep_only(row: torch.Tensor, ids: list[int] | torch.Tensor) -> None:
    """``-inf`` in place at every entry of ``row`` but ``ids``."""
    kept = row[ids]
    row.fill_(float("-inf"))
    row[ids] = kept


def constrain_rows(
    seqs: list[Sequence],  # [L] the sequence of each row
    logits: torch.Tensor,  # [L, V] raw logits, changed in place
    positions: list[int],  # [L] the draft position j of each row
) -> None:
    """What a request's parameters do to its raw logits before any sampling step, in place, at
    draft position ``j`` (after the first ``j`` drafts, as plain decoding would have them).

    ``logit_bias`` is added first, then transformers' ``sequence_bias``
    (:func:`specdec.token_rules.sequence_bias_row`); tokens outside ``allowed_token_ids``, the
    last token of a bad word whose other tokens end the output, what transformers' rules forbid
    (:func:`specdec.token_rules.generate_rule_bans`) and, first of all the output,
    ``begin_suppress_tokens`` get ``-inf``. A sequence still short of its ``min_tokens``
    cannot end there: its end-of-sequence and stop token ids get ``-inf`` logits, as
    transformers' ``MinNewTokensLengthLogitsProcessor`` and vLLM's ``min_tokens`` do. Penalties follow
    (:func:`specdec.token_rules.apply_penalties`), then transformers' forcing rules and length
    decay (:func:`specdec.token_rules.apply_position_rules`: a forced token is allowed whatever
    came before), then the request's own ``logits_processors``
    (:func:`specdec.token_rules.apply_logits_processors`), then a guide's (``choice``,
    ``regex``, ``json_schema``, ``grammar``): every token it does not allow there gets
    ``-inf``."""
    for row, (seq, j) in enumerate(zip(seqs, positions)):
        params = seq.params
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=logits.device)
            bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
            logits[row, ids] += bias.to(logits.device)
        # transformers' rules read the prompt too, and the first j drafts
        reads_context = params.sequence_bias or params.has_generate_rules
        context = seq.token_ids + seq.spec_token_ids[:j] if reads_context else []
        if params.sequence_bias:
            extra = sequence_bias_row(params.sequence_bias, context, logits.shape[1])
            logits[row] += extra.to(logits.device, logits.dtype)
        if seq.allowed_ids is not None:  # a tensor: indexing by a long list is slow
            keep_only(logits[row], seq.allowed_ids.to(logits.device))
        banned = banned_word_ends(seq, j) if seq.bad_word_ids else []
        if params.has_generate_rules:
            banned += generate_rule_bans(params, context)
        if params.begin_suppress_tokens and seq.num_output_tokens + j == 0:
            banned += params.begin_suppress_tokens
        if banned:
            logits[row, torch.tensor(banned, device=logits.device)] = float("-inf")
        if seq.num_output_tokens + j < params.min_tokens:
            logits[row, ending_ids(seq)] = float("-inf")
        if params.has_penalties:  # the drafts before row j count as generated
            output = seq.output_token_ids + seq.spec_token_ids[:j]
            apply_penalties(logits[row], params, seq.prompt_token_ids, output)
        if params.has_position_rules:
            apply_position_rules(
                logits[row],
                params,
                seq.num_output_tokens + j,
                seq.num_prompt_tokens,
                ending_ids(seq),
            )
        if params.logits_processors:  # the drafts before row j count as generated
            output = seq.output_token_ids + seq.spec_token_ids[:j]
            logits[row] = apply_logits_processors(logits[row], params, seq.prompt_token_ids, output)
        allowed = seq.allowed_tokens(j)  # None without a guide
        if isinstance(allowed, torch.Tensor):  # a [V] mask
            logits[row].masked_fill_(~allowed.to(logits.device), float("-inf"))
        elif allowed is not None:
            keep_only(logits[row], allowed)
