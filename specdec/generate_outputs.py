"""How the engine's outputs become the tensors transformers' ``generate`` hands back, for
:mod:`specdec.wrap`: ``sequences`` (beam search's too), per-step ``scores`` and ``logits``, and
``hidden_states``."""

from __future__ import annotations

import torch
import transformers

from specdec.beam_search import Beam
from specdec.config import SamplingParams
from specdec.generate_semantics import processed_row
from specdec.loader import eos_ids_of
from specdec.sampling import process_logits_for


def pad_id(config: transformers.GenerationConfig) -> int:
    """``pad_token_id``, else the first EOS id (as transformers falls back), else 0."""
    if config.pad_token_id is not None:
        return int(config.pad_token_id)
    eos = eos_ids_of(config)
    return eos[0] if eos else 0


def assemble(
    input_ids: torch.Tensor,  # [B, L]
    new_tokens: list[list[int]],  # [B] each row's generated tokens
    config: transformers.GenerationConfig,
) -> torch.Tensor:  # [B, L + longest]
    """transformers' output: each input row as given, then its new tokens, padded on the
    right with ``pad_token_id`` to the longest row's."""
    width = max(len(tokens) for tokens in new_tokens)
    new = torch.full((len(new_tokens), width), pad_id(config), dtype=input_ids.dtype)
    for row, tokens in enumerate(new_tokens):
        new[row, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)


def beam_sequences(
    input_ids: torch.Tensor,  # [B, L]
    completed: list[list[Beam]],  # [B] each prompt's completed hypotheses, best first
    config: transformers.GenerationConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' beam-search output: each prompt's ``num_return_sequences`` best
    hypotheses as ``[B * n, L + longest]`` sequences (padded on the right as transformers pads
    them: ``pad_token_id`` unless it is 0 or unset, then the first EOS id, and -1 without EOS
    ids), their ``sequences_scores`` and their ``beam_indices`` (-1 past each one's end)."""
    copies = config.num_return_sequences or 1
    empty = Beam(normalized=-1e9)  # a slot nothing completed (transformers' initial score)
    chosen = [b for beams in completed for b in (beams + [empty] * copies)[:copies]]
    width = max(len(b.token_ids) for b in chosen)
    eos = eos_ids_of(config)
    fill = (config.pad_token_id or eos[0]) if eos else -1
    new = torch.full((len(chosen), width), fill, dtype=torch.int64)
    indices = torch.full((len(chosen), width), -1, dtype=torch.int32)
    for row, beam in enumerate(chosen):
        new[row, : len(beam.token_ids)] = torch.tensor(beam.token_ids, dtype=torch.int64)
        indices[row, : len(beam.slots)] = torch.tensor(beam.slots, dtype=torch.int32)
    sequences = torch.cat([input_ids.cpu().repeat_interleave(copies, dim=0), new], dim=1)
    scores = torch.tensor([b.normalized for b in chosen], dtype=torch.float32)
    return sequences.to(input_ids.device), scores, indices


def scores(
    logits: list[torch.Tensor | None],  # [B] each [n_b, V] raw logits of row b's tokens
    params: list[SamplingParams],  # [B]
    prompts: list[list[int]],  # [B] each row's prompt
    outputs: list[list[int]],  # [B] each row's generated tokens
    renormalize: bool = False,  # transformers' renormalize_logits
) -> list[torch.Tensor | None]:  # [B] each [n_b, V]
    """transformers' ``scores``, up to a constant per row: the logits after the processors
    (``sequence_bias`` added, ``repetition_penalty`` over the prompt and the tokens before each
    step, ``min_new_tokens`` masks the EOS ids, ``suppress_tokens``, ``begin_suppress_tokens``,
    ``bad_words_ids`` and ``no_repeat_ngram_size`` mask what they forbid, the forcing rules and
    ``exponential_decay_length_penalty``) and, when sampling,
    log-probabilities after the warpers (temperature, top-k, top-p, min-p, typical, epsilon and
    eta); ``compute_transition_scores`` gives the same log-probabilities either way. With
    ``renormalize``, greedy rows too are log-probabilities (transformers' ``LogitNormalization``)."""
    scores: list[torch.Tensor | None] = []
    for rows, sp, prompt, output in zip(logits, params, prompts, outputs):
        if rows is None:
            scores.append(None)
            continue
        rows = torch.stack(
            [processed_row(row, sp, prompt, output[:t]) for t, row in enumerate(rows)]
        )
        if not sp.is_greedy:  # log-probabilities: normalised already
            rows = process_logits_for(rows, [sp] * len(rows)).log()
        elif renormalize:
            rows = torch.log_softmax(rows, dim=-1)
        scores.append(rows)
    return scores


def per_step(rows: list[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    """``[B]`` tensors of ``[n_b, V]`` as transformers' tuple of one ``[B, V]`` per step;
    a row that had already ended reads zeros there."""
    present = [r for r in rows if r is not None]
    steps, vocab = max(len(r) for r in present), present[0].shape[1]
    out = torch.zeros(steps, len(rows), vocab)
    for b, r in enumerate(rows):
        if r is not None:
            out[: len(r), b] = r
    return tuple(out.unbind(0))


def hidden_steps(
    states: list[torch.Tensor | None],  # [B] each [layers + 1, P_b + n_b - 1, H]
    attention_mask: torch.Tensor,  # [B, L] 1 where row b's prompt tokens are
    num_new: list[int],  # [B] each row's generated tokens
) -> tuple[tuple[torch.Tensor, ...], ...]:
    """transformers' ``hidden_states``: per generated token, per layer (the embeddings first,
    the final norm's output last), ``[B, L, H]`` at the first step (each row's prompt states at
    its mask's positions) and ``[B, 1, H]`` after; a padding position, or a row that has
    ended, reads zeros (transformers computes states for its pad tokens there)."""
    present = [s for s in states if s is not None]
    layers, _, size = present[0].shape
    length = attention_mask.shape[1]
    first = torch.zeros(layers, len(states), length, size, dtype=present[0].dtype)
    later = torch.zeros(max(num_new) - 1, layers, len(states), 1, size, dtype=first.dtype)
    for b, (row, n) in enumerate(zip(states, num_new)):
        if row is None:
            continue
        where = attention_mask[b].cpu().bool()
        prompt = int(where.sum())
        first[:, b, where] = row[:, :prompt]
        for t in range(n - 1):
            later[t, :, b, 0] = row[:, prompt + t]
    return (tuple(first.unbind(0)), *(tuple(step.unbind(0)) for step in later))


def attention_steps(
    rows: list[list[torch.Tensor] | None],  # [B] per fed position p, [layers, heads, p + 1]
    attention_mask: torch.Tensor,  # [B, L] 1 where row b's prompt tokens are
    num_new: list[int],  # [B] each row's generated tokens
    dtype: torch.dtype,
) -> tuple[tuple[torch.Tensor, ...], ...]:
    """transformers' ``attentions``: per generated token, per layer, ``[B, heads, L, L]`` at the
    first step and ``[B, heads, 1, L + t]`` at step ``t``, the columns those of the padded input
    and then of the tokens generated so far; a padding position, or a row that has ended, reads
    zeros (transformers also computes its pad tokens' attention)."""
    present = [r for r in rows if r]
    layers, heads, _ = present[0][0].shape
    length, batch = attention_mask.shape[1], len(rows)
    first = torch.zeros(layers, batch, heads, length, length, dtype=dtype)
    later = [
        torch.zeros(layers, batch, heads, 1, length + t, dtype=dtype)
        for t in range(1, max(num_new))
    ]
    for b, (positions, n) in enumerate(zip(rows, num_new)):
        if not positions:
            continue
        where = attention_mask[b].cpu().bool().nonzero().flatten()  # prompt position -> column
        prompt = len(where)
        for j in range(prompt):
            first[:, b, :, where[j], where[: j + 1]] = positions[j].to(dtype)
        for t in range(1, n):
            probs = positions[prompt + t - 1]  # over the prompt, then t generated tokens
            later[t - 1][:, b, :, 0, where] = probs[..., :prompt].to(dtype)
            later[t - 1][:, b, :, 0, length:] = probs[..., prompt:].to(dtype)
    return tuple(tuple(step.unbind(0)) for step in (first, *later))
