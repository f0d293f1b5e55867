"""transformers' ``generate`` semantics, for :mod:`specdec.wrap`: how a call's generation
config is resolved and checked, how its inputs become prompts and sampling parameters, how
each row's logits are processed, and how its stopping criteria end rows (the outputs' tensors:
:mod:`specdec.generate_outputs`).

Terms follow transformers: *processors* change logits (``min_new_tokens`` masks the EOS ids),
*warpers* shape the sampling distribution (temperature, top-k, top-p, min-p).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers.generation import logits_process
from transformers.generation.logits_process import LogitsProcessor

from specdec.beam_search import check_early_stopping
from specdec.config import SamplingParams
from specdec.llm import LLM
from specdec.loader import eos_ids_of
from specdec.outputs import RequestOutput, merge_delta
from specdec.token_rules import (
    apply_logits_processors,
    apply_penalties,
    apply_position_rules,
    generate_rule_bans,
    sequence_bias_row,
)

# Generation-config fields the engine does not implement, with the values that leave them off.
UNSUPPORTED = {
    "num_beam_groups": (None, 1),
    "penalty_alpha": (None,),
    "encoder_repetition_penalty": (None, 1.0),
    "force_words_ids": (None,),
    "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
    "top_h": (None,),
    "remove_invalid_values": (None, False),
    "token_healing": (None, False),
    "dola_layers": (None,),
    "constraints": (None,),
}


def resolve_config(
    model: transformers.PreTrainedModel, given: transformers.GenerationConfig | None
) -> transformers.GenerationConfig:
    """The call's generation config as transformers resolves it: ``given`` (else an empty one),
    its unset fields taken from the model's own config, then from transformers' defaults
    (``top_k=50``, ``max_length=20``, ...)."""
    config = copy.deepcopy(given or transformers.GenerationConfig())
    own = model.generation_config.to_dict()
    config.update(**own, defaults_only=True, allow_custom_entries=True)
    config.update(**config._get_default_generation_params(), defaults_only=True)
    return config


def check_config(config: transformers.GenerationConfig) -> None:
    """Refuse generation options the engine does not implement, naming them."""
    for name, neutral in UNSUPPORTED.items():
        if getattr(config, name, None) not in neutral:
            raise ValueError(
                f"generate(..., {name}={getattr(config, name)!r}) is not supported by "
                f"specdec.wrap; leave it at {neutral[-1]!r}"
            )
    if config.do_sample and not (config.temperature or 0) > 0:
        raise ValueError(
            f"`temperature` (={config.temperature}) has to be a strictly positive float when "
            "do_sample=True; use do_sample=False for greedy decoding"
        )


def check_beam_config(config: transformers.GenerationConfig) -> None:
    """Refuse what beam search (``num_beams > 1``) cannot do here, as transformers words it
    where it refuses the same."""
    copies = config.num_return_sequences or 1
    if copies > config.num_beams:
        raise ValueError(
            f"`num_return_sequences` (={copies}) has to be smaller or equal to `num_beams` "
            f"(={config.num_beams})"
        )
    check_early_stopping(config.early_stopping)


def prompt_rows(
    input_ids: torch.Tensor,  # [B, L]
    attention_mask: torch.Tensor | None,  # [B, L] 1 for a token, 0 for padding
    config: transformers.GenerationConfig,
) -> list[list[int]]:
    """Each row's prompt: its tokens where the mask (:func:`prompt_mask`) is 1."""
    attention_mask = prompt_mask(input_ids, attention_mask, config)
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
    if any(not row for row in rows):
        raise ValueError("a row of input_ids has no token under its attention_mask")
    penalty = config.repetition_penalty
    if penalty not in (None, 1.0) and any(len(row) < input_ids.shape[1] for row in rows):
        raise ValueError(
            "repetition_penalty with padded rows is not supported by specdec.wrap: transformers "
            "counts the padding tokens as context (penalising the pad id, often an EOS id); "
            "give rows of one length, or one row per call"
        )
    return rows


def prompt_mask(
    input_ids: torch.Tensor,  # [B, L]
    attention_mask: torch.Tensor | None,  # [B, L] 1 for a token, 0 for padding
    config: transformers.GenerationConfig,
) -> torch.Tensor:  # [B, L]
    """The call's attention mask, checked; without one, as transformers infers it: padding is
    ``pad_token_id`` where it occurs and differs from every EOS id."""
    if attention_mask is None:
        pad, eos = config.pad_token_id, eos_ids_of(config)
        if pad is not None and pad not in eos and bool((input_ids == pad).any()):
            return input_ids != pad
        return torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, "
            f"input_ids {tuple(input_ids.shape)}"
        )
    return attention_mask


def sampling_params(
    config: transformers.GenerationConfig,
    input_length: int,
    seeds: list[int],
    processors: list[LogitsProcessor] | None = None,
) -> list[SamplingParams]:
    """The engine's parameters for each row, from a generation config (transformers'
    semantics: ``max_length`` and ``min_length`` count the padded input; the config's EOS ids,
    and only those, end a row)."""
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    else:
        max_new = config.max_length - input_length
    if max_new < 1:
        raise ValueError(
            f"Input length of input_ids is {input_length}, but `max_length` is set to "
            f"{config.max_length}: set max_new_tokens to generate anything"
        )
    min_new = config.min_new_tokens or max(0, (config.min_length or 0) - input_length)
    sample = bool(config.do_sample)
    eos = eos_ids_of(config)  # transformers drops a bad word that is an EOS id alone
    bad_words = [list(w) for w in config.bad_words_ids or [] if not (len(w) == 1 and w[0] in eos)]
    begin = list(config.begin_suppress_tokens or [])
    forced_eos = config.forced_eos_token_id
    decay = config.exponential_decay_length_penalty
    custom = [as_row_processor(p) for p in processors or []] or None
    return [
        SamplingParams(
            max_tokens=max_new,
            min_tokens=min(min_new, max_new),
            temperature=float(config.temperature or 1.0) if sample else 0.0,
            top_k=int(config.top_k or 0) if sample else 0,
            top_p=float(config.top_p or 1.0) if sample else 1.0,
            min_p=float(config.min_p or 0.0) if sample else 0.0,
            typical_p=float(config.typical_p if sample and config.typical_p is not None else 1.0),
            epsilon_cutoff=float(config.epsilon_cutoff or 0.0) if sample else 0.0,
            eta_cutoff=float(config.eta_cutoff or 0.0) if sample else 0.0,
            repetition_penalty=float(config.repetition_penalty or 1.0),  # greedy rows too
            seed=seed,
            stop_token_ids=list(eos),
            ignore_eos=True,  # the config's EOS ids above, not the engine's, end a row
            suppress_tokens=list(config.suppress_tokens) if config.suppress_tokens else None,
            begin_suppress_tokens=begin or None,
            sequence_bias=config.sequence_bias or None,
            bad_words_ids=bad_words or None,
            no_repeat_ngram_size=int(config.no_repeat_ngram_size or 0),
            # transformers forces BOS where the whole (padded) input is one token
            forced_bos_token_id=config.forced_bos_token_id if input_length == 1 else None,
            forced_eos_token_id=list(forced_eos) if isinstance(forced_eos, list) else forced_eos,
            exponential_decay_length_penalty=tuple(decay) if decay is not None else None,
            return_logits=bool(config.output_scores or config.output_logits),
            return_hidden_states=bool(config.output_hidden_states),
            return_attentions=bool(config.output_attentions),
            logits_processors=custom,
            detokenize=bool(config.stop_strings),  # generate returns tokens: text only for them
            stop_strings=config.stop_strings or None,  # in the text of every token, as
            skip_special_tokens=False,  # transformers' StopStringCriteria reads it
        )
        for seed in seeds
    ]


def as_row_processor(
    processor: LogitsProcessor,
) -> Callable[[list[int], list[int], torch.Tensor], torch.Tensor]:
    """A transformers ``LogitsProcessor`` as the engine calls a request's processors: on one
    row, with ``input_ids`` the row's prompt and the tokens before it (``[1, L]``; a batch's
    left padding is not part of it, as for the n-gram rules)."""

    def on_row(prompt: list[int], output: list[int], row: torch.Tensor) -> torch.Tensor:
        return processor(torch.tensor([prompt + output]), row[None])[0]

    return on_row


def processed_row(
    row: torch.Tensor,  # [V] logits (or, in beam search, log-probabilities)
    sp: SamplingParams,
    prompt: list[int],
    before: list[int],  # the tokens generated before this one
) -> torch.Tensor:  # [V] a new tensor
    """One row after transformers' logits processors, in the order they run (``sequence_bias``
    first, then the forcing rules and the length decay, as the engine applies them, then the
    caller's own ``logits_processor``)."""
    row = row.clone()
    position = len(before)
    if sp.sequence_bias:
        row += sequence_bias_row(sp.sequence_bias, prompt + before, row.shape[0])
    if sp.repetition_penalty != 1:
        apply_penalties(row, sp, prompt, before)
    if sp.has_generate_rules:
        row[generate_rule_bans(sp, prompt + before)] = float("-inf")
    if position < sp.min_tokens:
        row[sp.stop_token_ids] = float("-inf")
    if position == 0 and sp.begin_suppress_tokens:
        row[sp.begin_suppress_tokens] = float("-inf")
    if sp.has_position_rules:  # see constrain_rows
        apply_position_rules(row, sp, position, len(prompt), sp.stop_token_ids)
    return apply_logits_processors(row, sp, prompt, before)  # a caller's own, last


def beam_warpers(config: transformers.GenerationConfig) -> list[LogitsProcessor]:
    """Beam sampling's warpers: transformers' own, built as ``generate`` builds them for
    ``num_beams > 1`` (each keeps at least one token more than there are EOS ids, so that a
    beam can go on). Beam sampling draws from their unnormalised output over every beam, which
    ``generate``'s classes define to the bit; the engine's sampler (``process_logits``) keeps
    one token at least and normalises, so it is not used here."""
    keep = max(2, len(eos_ids_of(config)) + 1)
    warpers: list[LogitsProcessor] = []
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(logits_process.TemperatureLogitsWarper(config.temperature))
    if config.top_k:
        warpers.append(logits_process.TopKLogitsWarper(config.top_k, min_tokens_to_keep=keep))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(logits_process.TopPLogitsWarper(config.top_p, min_tokens_to_keep=keep))
    if config.min_p is not None:
        warpers.append(logits_process.MinPLogitsWarper(config.min_p, min_tokens_to_keep=keep))
    if config.typical_p is not None and config.typical_p < 1.0:
        warpers.append(
            logits_process.TypicalLogitsWarper(config.typical_p, min_tokens_to_keep=keep)
        )
    if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
        warpers.append(
            logits_process.EpsilonLogitsWarper(config.epsilon_cutoff, min_tokens_to_keep=keep)
        )
    if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
        warpers.append(logits_process.EtaLogitsWarper(config.eta_cutoff, min_tokens_to_keep=keep))
    return warpers


def generate_until(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], criteria: list[Any]
) -> list[RequestOutput]:
    """``llm.generate``, each row also ending at the first token after which one of
    transformers' ``stopping_criteria`` holds for it (that token kept, as ``generate`` keeps
    it); the engine drops the row there, tokens it drafted past the stop included."""
    engine = llm.engine
    ids = []
    totals: dict[int, RequestOutput] = {}
    try:
        for prompt, sp in zip(prompts, params):
            ids.append(engine.add_request(prompt, sp))
            totals[ids[-1]] = RequestOutput(ids[-1], prompt)
        while engine.has_unfinished():
            for delta in engine.step():
                total = totals[delta.request_id]
                start = len(total.token_ids)
                merge_delta(total, delta)
                stop = first_stop(criteria, total, start)
                if stop is not None:
                    cut_output(total, stop)
                    engine.abort(delta.request_id)
    except BaseException:
        for request_id in ids:
            engine.abort(request_id)
        raise
    return [totals[i] for i in ids]


def first_stop(criteria: list[Any], total: RequestOutput, start: int) -> int | None:
    """The length of ``total``'s output up to the first of its tokens from ``start`` on after
    which a criterion holds (None: none does)."""
    for end in range(start + 1, len(total.token_ids) + 1):
        if criteria_met(criteria, total.prompt_token_ids + total.token_ids[:end]):
            return end
    return None


def criteria_met(criteria: list[Any], tokens: list[int]) -> bool:
    """Whether one of transformers' stopping criteria holds for a row of these tokens (called
    as ``generate`` calls them, on ``[1, L]`` ids; the scores they are given are None)."""
    ids = torch.tensor([tokens])
    return any(bool(criterion(ids, None)[0]) for criterion in criteria)


def cut_output(total: RequestOutput, length: int) -> None:
    """End ``total`` after its first ``length`` tokens."""
    total.token_ids = total.token_ids[:length]
    if total.logits is not None:
        total.logits = total.logits[:length]
    total.finished, total.finish_reason = True, "stop"
