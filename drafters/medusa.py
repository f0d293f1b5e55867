"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads"): ``K`` small residual blocks on the target's last hidden state, head
``i`` guessing the token ``i + 1`` places after the one the target just predicted.

At the position ``t`` whose logits gave the sequence's newest token ``x[t + 1]``, the target's
final hidden state ``h[t]`` is already computed. Head ``i`` (``i = 1 .. K``) maps it through one
residual block, ``h + SiLU(W_i h + b_i)``, and the shared output layer (the target's rows for the
reduced draft vocabulary, see drafters/heads.py) to a guess of ``x[t + 1 + i]``. All ``K`` drafts
come from one hidden state in one batched pass: no forward of a model of the drafter's own, no
KV cache, no state kept between steps (Medusa-1, with the target frozen; its tree of candidates
is a later issue: this proposes one chain, each head's top token).

Drafts are chosen by the target's own rule on the head's logits, with the noise of the position
drafted (as drafters/draft_model.py does): greedy requests take the argmax, sampled ones the
winner of the exponential race, so a sampled draft is the target's token whenever the two races
agree. Verification is unchanged, so heads change speed, never output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specdec.drafters.base import DrafterBase, FinishedStep
from specdec.drafters.heads import DraftVocabHead, HeadsConfig, HeadsOptions, load_for_target
from specdec.sequence import Sequence

if TYPE_CHECKING:
    from specdec.engine import Engine


class MedusaHeads(nn.Module):
    """``K`` residual blocks ``h -> h + SiLU(W_i h + b_i)``; ``W_i = 0`` at init, so that every
    head starts out guessing the target's own next token (as Medusa initialises them)."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        blocks = [nn.Linear(hidden_size, hidden_size) for _ in range(num_heads)]
        for block in blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.blocks = nn.ModuleList(blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [K, N, H]
        return torch.stack([hidden + nn.functional.silu(block(hidden)) for block in self.blocks])


class MedusaDrafter(DrafterBase):
    name = "medusa"
    Options = HeadsOptions
    prior_acceptance = 0.5
    drafts_in_one_pass = True  # every head in one pass

    def __init__(self, heads: MedusaHeads, head: DraftVocabHead):
        self.heads = heads
        self.head = head
        self.num_heads = len(heads.blocks)
        self.max_drafts = self.num_heads
        self.draft_forward = self._timing_forward

    @classmethod
    def build(cls, options: Any, engine: Engine, target: Any) -> MedusaDrafter:
        heads, vocab = load_for_target(options, "medusa", engine.runner.model, medusa_heads)
        assert isinstance(heads, MedusaHeads)
        return cls(heads, vocab)

    @torch.inference_mode()
    def _timing_forward(self, n: int) -> None:
        """Every head over ``n`` sequences, as the policy prices a draft step."""
        weight = self.head.weight
        for features in self.heads(weight.new_zeros(n, weight.shape[1])):
            self.head.logits(features)
        if weight.device.type == "cuda":
            torch.cuda.synchronize(weight.device)  # timed by the caller: wait for the GPU

    @torch.inference_mode()
    def propose(
        self, seqs: list[Sequence], num_drafts: list[int], step: FinishedStep | None = None
    ) -> None:
        for seq in seqs:
            seq.spec_token_ids = []
        if step is None:
            return
        rows = _last_rows(step)  # seq_id -> row of its newest token's hidden state
        drafting = [
            (seq, min(k, self.num_heads))
            for seq, k in zip(seqs, num_drafts)
            if k and seq.seq_id in rows
        ]
        if not drafting:
            return
        hidden = step.result.hidden_states
        index = torch.tensor([rows[seq.seq_id] for seq, _ in drafting], device=hidden.device)
        features = self.heads(hidden[index])  # [K, A, H]
        depth = max(k for _, k in drafting)
        for j in range(depth):  # head j + 1 drafts position num_tokens + j
            live = [a for a, (_, k) in enumerate(drafting) if k > j]
            chosen = [drafting[a][0] for a in live]
            tokens = self.head.draft(features[j, live], chosen)
            for seq, token in zip(chosen, tokens):
                seq.spec_token_ids.append(token)


def medusa_heads(config: HeadsConfig) -> MedusaHeads:
    return MedusaHeads(config.hidden_size, config.num_heads)


def _last_rows(step: FinishedStep) -> dict[int, int]:
    """For each sequence that sampled this step, the row of ``step.result.hidden_states`` at
    the position whose logits gave its newest token (its last accepted draft's row)."""
    rows, start = {}, 0
    res, scheduled = step.result, step.scheduled
    num_accepted = step.verification.num_accepted  # a list built per call: take it once
    for i, num_rows in zip(res.sample_indices, res.num_logit_rows):
        seq = scheduled.seqs[i]
        accepted = num_accepted[i]
        if not seq.is_finished:
            rows[seq.seq_id] = start + accepted
        start += num_rows
    return rows
