"""Token rules over a row's context: the penalties, vLLM's bad words, and transformers' rules
(n-gram repeats, bad words, suppression, sequence bias, forcing and length decay), and a
request's own logits processors.

Each reads the tokens before a row (the prompt, the output and, in a verification step, the drafts
before the row), so that the verifier's ``constrain_rows`` applies them at each row with the
drafts before it counted, and :mod:`specdec.wrap`'s scores apply them to the rows it returns.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from specdec.config import SamplingParams


def apply_penalties(
    logits: torch.Tensor,  # [V] one row's raw logits, penalised in place
    params: SamplingParams,  # the row's request
    prompt: Sequence[int],  # its prompt
    output: Sequence[int],  # the tokens generated before the row
) -> None:
    """vLLM's repetition, presence and frequency penalties on one row.

    Repetition (Keskar et al. 2019, "CTRL", as transformers' ``RepetitionPenaltyLogitsProcessor``
    applies it): a token of the prompt or of the output has a positive logit divided by the
    penalty, a negative one multiplied by it. Presence and frequency (OpenAI's definitions, on
    the output only): ``logit -= frequency * count + presence`` for every token generated before
    the row. A row's history is that of plain decoding at its position, so that verification
    (whose row ``j`` follows ``j`` drafts) decides the token plain decoding would.
    """
    device = logits.device
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted({*prompt, *output}), dtype=torch.long).to(device)
        values, penalty = logits[seen], params.repetition_penalty
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if output and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(list(output), dtype=torch.long).unique(return_counts=True)
        amount = params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
        logits[ids.to(device)] -= amount.to(device)


def word_ends(words: Sequence[Sequence[int]], context: Sequence[int]) -> list[int]:
    """The last token of each word (a token sequence) whose other tokens end ``context``; a
    one-token word always: the tokens that would complete a word next."""
    ends = []
    for word in words:
        m = len(word) - 1
        if m == 0 or (len(context) >= m and list(context[len(context) - m :]) == list(word[:m])):
            ends.append(word[m])
    return ends


def repeated_ngram_ends(context: Sequence[int], n: int) -> list[int]:
    """The tokens that would complete an ``n``-gram already in ``context``: those that followed
    an earlier occurrence of its last ``n - 1`` tokens (transformers'
    ``NoRepeatNGramLogitsProcessor``)."""
    m = n - 1
    tokens = np.asarray(context, dtype=np.int64)
    if m == 0:
        return np.unique(tokens).tolist()
    if len(tokens) <= m:  # no n-gram yet
        return []
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], m)  # [L - m, m] prefixes
    hits = np.flatnonzero((windows == tokens[len(tokens) - m :]).all(axis=1))
    return np.unique(tokens[hits + m]).tolist()


def generate_rule_bans(params: SamplingParams, context: Sequence[int]) -> list[int]:
    """The tokens transformers' ``suppress_tokens``, ``bad_words_ids`` and
    ``no_repeat_ngram_size`` forbid after ``context`` (the prompt and the tokens generated
    before the row): what :mod:`specdec.wrap` passes on from ``generate``."""
    banned = list(params.suppress_tokens or [])
    if params.bad_words_ids:
        banned += word_ends(params.bad_words_ids, context)
    if params.no_repeat_ngram_size:
        banned += repeated_ngram_ends(context, params.no_repeat_ngram_size)
    return banned


def forced_tokens(params: SamplingParams, generated: int, prompt_len: int) -> list[int] | None:
    """The tokens transformers' forcing rules leave a row (the one row ``generated`` tokens into
    the output of a ``prompt_len``-token prompt): ``forced_eos_token_id`` at the last token
    ``max_tokens`` allows, ``forced_bos_token_id`` where the context is one token; else None."""
    if params.forced_eos_token_id is not None and generated == params.max_tokens - 1:
        return params.forced_eos_ids
    if params.forced_bos_token_id is not None and prompt_len + generated == 1:
        return [params.forced_bos_token_id]
    return None


def decays_length(params: SamplingParams, generated: int) -> bool:
    """Whether ``exponential_decay_length_penalty`` changes a row ``generated`` tokens in."""
    decay = params.exponential_decay_length_penalty
    return decay is not None and generated > decay[0]


def apply_position_rules(
    row: torch.Tensor,  # [V] logits after the bans and penalties, changed in place
    params: SamplingParams,
    generated: int,  # tokens generated before the row (drafts before it included)
    prompt_len: int,
    eos_ids: Sequence[int],  # the ids that end the request (the decay raises their logits)
) -> None:
    """transformers' ``ForcedBOSTokenLogitsProcessor``, ``ForcedEOSTokenLogitsProcessor`` and
    ``ExponentialDecayLengthPenalty``, in that order, on one row: a forced row is ``-inf`` but
    for its tokens, at 0; past ``start`` generated tokens each finite end-of-sequence logit
    ``x`` becomes ``x + |x| * (factor ** (generated - start) - 1)``, the same float32 operations
    as transformers'."""
    forced = forced_tokens(params, generated, prompt_len)
    if forced is not None:
        row.fill_(float("-inf"))
        row[forced] = 0.0
    decay = params.exponential_decay_length_penalty
    if decay is not None and generated > decay[0] and eos_ids:
        ids = torch.tensor(list(eos_ids), device=row.device)
        eos = row[ids]
        penalty = eos.abs() * (pow(decay[1], generated - decay[0]) - 1)
        row[ids] = eos + penalty.masked_fill(~torch.isfinite(eos), 0.0)


def sequence_bias_row(
    bias: dict[tuple[int, ...], float], context: Sequence[int], vocab: int
) -> torch.Tensor:  # [vocab] float32
    """transformers' ``SequenceBiasLogitsProcessor`` for one row, as the ``[vocab]`` float32
    vector it adds to the raw logits after ``context`` (the prompt and the tokens generated
    before the row): each one-token sequence's bias at its token, then, by length of the
    tokens before the last in order of first appearance, each sequence whose other tokens end
    ``context`` adds its bias at its last token (the same float32 additions in the same order)."""
    row = torch.zeros(vocab)
    singles = [(ids[0], b) for ids, b in bias.items() if len(ids) == 1]
    if singles:
        row[[t for t, _ in singles]] = torch.tensor([b for _, b in singles])
    by_length: dict[int, list[tuple[tuple[int, ...], float]]] = {}
    for ids, b in bias.items():
        if len(ids) > 1:
            by_length.setdefault(len(ids) - 1, []).append((ids, b))
    for m, group in by_length.items():
        if m > len(context):  # longer than the context: never matches
            continue
        tail = tuple(context[len(context) - m :])
        matched = torch.tensor([b if ids[:-1] == tail else 0.0 for ids, b in group])
        row.index_add_(0, torch.tensor([ids[-1] for ids, _ in group]), matched)
    return row


def apply_logits_processors(
    logits: torch.Tensor,  # [V] one row, after the built-in rules
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],  # the tokens generated before the row (drafts included)
) -> torch.Tensor:  # [V] the row after each of params.logits_processors, in order
    """vLLM's (v0) per-request logits processors: ``fn(output_token_ids, logits)``, or
    ``fn(prompt_token_ids, output_token_ids, logits)`` where ``fn`` takes three parameters.

    A processor is called on every row a token is decided from, drafts' rows included, with
    the tokens before that row: under speculation it sees drafts that may be rejected and may
    see a position more than once, so it must be a function of its arguments (no state kept
    between calls) for the output to equal plain decoding's."""
    vocab = logits.shape[0]
    for fn in params.logits_processors or ():
        given = (
            fn(list(prompt), list(output), logits)
            if _takes_prompt(fn)
            else fn(list(output), logits)
        )
        if not (isinstance(given, torch.Tensor) and given.shape == (vocab,)):
            got = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
            raise ValueError(f"a logits processor returned {got}, not a [{vocab}] tensor")
        logits = given
    return logits


def _takes_prompt(fn: Callable[..., Any]) -> bool:
    try:
        return len(inspect.signature(fn).parameters) == 3
    except (TypeError, ValueError):  # no signature (a builtin): vLLM's two-argument form
        return False
