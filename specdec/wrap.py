"""``specdec.wrap(model)``: a transformers model's ``generate``, run on the specdec engine.

Existing code keeps its call::

    fast = specdec.wrap(model, tokenizer)        # was: model
    out = fast.generate(input_ids, attention_mask=mask, max_new_tokens=64)

and gets the same ``[batch, prompt + new]`` tensor back (left padding kept, finished rows padded
with ``pad_token_id``), or an output object with ``sequences`` under
``return_dict_in_generate=True``. ``assistant_model=`` and ``prompt_lookup_num_tokens=`` switch
to the engine's ``draft_model`` and ``prompt_lookup`` drafters, at any batch size; options given
to ``wrap`` (``drafter="eagle"``, ...) speculate on every call that names no assistant. The
engine's adaptive policy sets the draft depth (at most ``prompt_lookup_num_tokens``, or 8 for
an assistant) unless ``num_assistant_tokens`` is given, which fixes it (transformers'
``"constant"`` schedule; ``"heuristic"`` keeps the policy, with that cap).

The engine runs on the model's own weights. ``wrap`` first makes each layer's q/k/v and
gate/up weights row blocks of one fused matrix (:func:`fuse_projections`: the transformers
modules keep their parameters, now views into it), which the native model then uses as its
fused projection; embeddings, output head, norms, o and down projections are the very tensors
transformers holds, and no huge-page copy is made. Where the CPU kernels are built, the linears
are then packed once for them (a copy of each linear's matrix: float32 in lanes, bfloat16 in
pairs; see :mod:`specdec.models.linear`), while the embedding and norms stay shared. Without the
kernels a float32 model is not copied at all.

Sampling follows ``generate``'s generation config (the model's own, updated by the call's
keyword arguments, as transformers does): ``do_sample``, ``temperature``, ``top_k`` (50 unless
set), ``top_p``, ``min_p``, ``max_new_tokens`` / ``max_length``, ``min_new_tokens`` /
``min_length``, ``eos_token_id`` (an int or a list), ``pad_token_id``,
``num_return_sequences``. Every row's noise seed is drawn from torch's global generator, so
``torch.manual_seed(s)`` before a call makes it reproducible, whatever the drafter or batch.
``return_dict_in_generate`` with ``output_logits`` / ``output_scores`` hands back the rows each
token was decided from, with ``output_hidden_states`` / ``output_attentions`` every layer's
states / attention probabilities at each fed token. ``logits_processor`` (transformers' processors, called on each row) and
``stopping_criteria`` / ``max_time`` (a row ends after the token past which one holds) work as
in ``generate``. ``num_beams > 1`` runs transformers' beam search (and beam sampling) on
the engine (:mod:`specdec.beam_search`). Options whose effect the engine does not implement
(contrastive search, guidance, watermarking, ...) are refused with a ``ValueError`` naming them,
never ignored.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn
from transformers.generation.stopping_criteria import MaxTimeCriteria, StopStringCriteria
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

from specdec import generate_outputs as tensors
from specdec import generate_semantics as hf
from specdec.beam_search import Search
from specdec.beam_search import run as run_search
from specdec.config import SamplingParams
from specdec.drafters.registry import SpecConfig
from specdec.llm import LLM
from specdec.loader import check_architecture, load_checkpoint
from specdec.models.llama import LlamaForCausalLM, rows_adjacent
from specdec.outputs import RequestOutput, merge_delta

MAX_ENGINES = 4  # engines (one per drafter asked for) kept across calls


def wrap(
    model: transformers.PreTrainedModel, tokenizer: Any = None, **spec_options: Any
) -> WrappedModel:
    """A drop-in ``generate`` for ``model`` on the specdec engine (see the module docstring).

    ``tokenizer``: the model's tokenizer, when its ``name_or_path`` is not a local directory
    holding one. ``spec_options``: a drafter for every call that names no assistant, as
    :class:`~specdec.SpecConfig` takes them (``drafter="prompt_lookup"``,
    ``num_speculative_tokens=8``, ...); ``engine_options={...}`` sizes the engine
    (:class:`~specdec.EngineConfig`'s fields).
    """
    engine_options = spec_options.pop("engine_options", None) or {}
    speculative = SpecConfig(**spec_options) if spec_options else None
    return WrappedModel(model, tokenizer, speculative, engine_options)


class WrappedModel:
    """``model`` with ``generate`` on the specdec engine; other attributes are the model's."""

    def __init__(
        self,
        model: transformers.PreTrainedModel,
        tokenizer: Any,
        speculative: SpecConfig | None,
        engine_options: dict[str, Any],
    ):
        check_placement(model)
        fuse_projections(model)
        dtype = model.dtype
        self.model = model
        self.speculative = speculative
        self.engine_options = engine_options
        self.checkpoint = load_checkpoint(model, tokenizer, dtype)
        max_len = engine_options.get("max_model_len") or model.config.max_position_embeddings
        self.native = LlamaForCausalLM.from_hf(
            self.checkpoint.config,
            self.checkpoint.state_dict,
            max_len,
            engine_options.get("batch_invariant"),
            huge_pages=False,  # the engine reads the model's own storage
        )
        self.checkpoint.state_dict = {}  # the native model holds what it needs
        self._engines: dict[tuple[Any, ...], LLM] = {}  # by drafter, most recent last
        self._llm: LLM | None = None  # the latest call's

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: transformers.GenerationConfig | None = None,
        streamer: Any = None,
        assistant_model: transformers.PreTrainedModel | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput | GenerateBeamDecoderOnlyOutput:
        """``transformers``' ``generate`` (decoder-only: greedy, sampled or beam search), on the
        engine."""
        input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
        attention_mask = kwargs.pop("attention_mask", None)
        tokenizer = kwargs.pop("tokenizer", None)  # for stop_strings (the engine has its own)
        processors = list(kwargs.pop("logits_processor", None) or [])
        criteria = list(kwargs.pop("stopping_criteria", None) or [])
        prompt_lookup = kwargs.pop("prompt_lookup_num_tokens", None)
        # asked for by the caller, not filled in from transformers' defaults (a constant 20)
        num_assistant_tokens = kwargs.get(
            "num_assistant_tokens", getattr(generation_config, "num_assistant_tokens", None)
        )
        config = hf.resolve_config(self.model, generation_config)
        unused = config.update(**kwargs)
        if unused:
            raise ValueError(
                f"The following `model_kwargs` are not used by the model: {sorted(unused)} "
                "(note: typos in the generate arguments will also show up in this list)"
            )
        hf.check_config(config)
        if config.max_time is not None:  # from now, as transformers starts its clock
            criteria.append(MaxTimeCriteria(config.max_time))
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] == 0:
            raise ValueError("input_ids must be a [batch, length] tensor of token ids")
        if (config.num_beams or 1) > 1:
            if streamer is not None:
                raise ValueError("`streamer` cannot be used with beam search: set num_beams=1")
            if assistant_model is not None or prompt_lookup is not None:
                raise ValueError(
                    "assisted generation (assistant_model, prompt_lookup_num_tokens) needs "
                    "num_beams=1, as in transformers"
                )
            if config.stop_strings:  # a candidate that completes one completes its beam
                text = tokenizer or self._engine(None, None, None, config).tokenizer
                criteria.append(StopStringCriteria(text, config.stop_strings))
            return self._beam_generate(input_ids, attention_mask, config, processors, criteria)
        if streamer is not None and input_ids.shape[0] > 1:
            raise ValueError("a streamer works at batch size 1 only, as in transformers")
        copies = config.num_return_sequences or 1
        # drawn first, before an engine is built, so that torch.manual_seed fixes them
        seeds = [int(torch.randint(2**63 - 1, ())) for _ in range(len(input_ids) * copies)]
        prompts = [
            p for p in hf.prompt_rows(input_ids, attention_mask, config) for _ in range(copies)
        ]
        params = hf.sampling_params(config, input_ids.shape[1], seeds, processors)
        llm = self._engine(assistant_model, prompt_lookup, num_assistant_tokens, config)
        if streamer is not None:
            outputs = [_stream(llm, prompts[0], params[0], input_ids, streamer, criteria)]
        elif criteria:
            outputs = hf.generate_until(llm, prompts, params, criteria)
        else:
            outputs = llm.generate(prompts, params)
        new_tokens = [out.token_ids for out in outputs]
        sequences = tensors.assemble(input_ids.repeat_interleave(copies, dim=0), new_tokens, config)
        if not config.return_dict_in_generate:
            return sequences
        logits = [out.logits for out in outputs]
        hidden = attentions = None
        if config.output_hidden_states or config.output_attentions:
            mask = hf.prompt_mask(input_ids, attention_mask, config).repeat_interleave(copies, 0)
            num_new = [len(tokens) for tokens in new_tokens]
            if config.output_hidden_states:
                states = [out.hidden_states for out in outputs]
                hidden = tensors.hidden_steps(states, mask, num_new)
            if config.output_attentions:
                probs = [out.attentions for out in outputs]
                attentions = tensors.attention_steps(probs, mask, num_new, self.model.dtype)
        scores = (
            tensors.scores(logits, params, prompts, new_tokens, bool(config.renormalize_logits))
            if config.output_scores
            else None
        )
        return GenerateDecoderOnlyOutput(
            sequences=sequences,  # type: ignore[arg-type]
            scores=tensors.per_step(scores) if scores else None,  # type: ignore[arg-type]
            logits=tensors.per_step(logits) if config.output_logits else None,  # type: ignore[arg-type]
            hidden_states=hidden,  # type: ignore[arg-type]
            attentions=attentions,  # type: ignore[arg-type]
        )

    def _beam_generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        config: transformers.GenerationConfig,
        processors: list[Any],
        criteria: list[Any],
    ) -> torch.Tensor | GenerateBeamDecoderOnlyOutput:
        """transformers' beam search (``num_beams > 1``, greedy), on the engine: see
        :mod:`specdec.beam_search`. The logits processors that ``generate`` applies (penalties,
        bans, forcing) change each step's log-probabilities, as in transformers."""
        hf.check_beam_config(config)
        for name in ("output_hidden_states", "output_attentions"):
            if getattr(config, name):
                raise ValueError(
                    f"{name} with num_beams > 1 is not supported by specdec.wrap; it is with "
                    "num_beams=1"
                )
        prompts = hf.prompt_rows(input_ids, attention_mask, config)
        rules = hf.sampling_params(config, input_ids.shape[1], [0], processors)[0]

        warpers = hf.beam_warpers(config) if config.do_sample else []
        no_ids = torch.empty(1, 0, dtype=torch.long)  # the warpers read no ids

        def process(row: torch.Tensor, prompt: list[int], tokens: list[int]) -> torch.Tensor:
            row = hf.processed_row(row, rules, prompt, tokens)[None]
            for warper in warpers:
                row = warper(no_ids, row)
            return torch.log_softmax(row, -1)[0] if config.renormalize_logits else row[0]

        record = bool(
            config.return_dict_in_generate and (config.output_scores or config.output_logits)
        )
        search = Search(
            width=config.num_beams,
            max_tokens=rules.max_tokens,
            eos=tuple(rules.stop_token_ids or ()),
            length_penalty=float(config.length_penalty),
            early_stopping=config.early_stopping,
            process=process,
            sample=bool(config.do_sample),
            stops=(lambda prompt, tokens: hf.criteria_met(criteria, prompt + tokens))
            if criteria
            else None,
            record=record,
        )
        result = run_search(self._engine(None, None, None, config), prompts, search)
        sequences, scores, indices = tensors.beam_sequences(input_ids, result.completed, config)
        if not config.return_dict_in_generate:
            return sequences
        return GenerateBeamDecoderOnlyOutput(
            sequences=sequences,  # type: ignore[arg-type]
            sequences_scores=scores if config.output_scores else None,  # type: ignore[arg-type]
            scores=tuple(result.scores) if config.output_scores else None,  # type: ignore[arg-type]
            logits=tuple(result.logits) if config.output_logits else None,  # type: ignore[arg-type]
            beam_indices=indices,  # type: ignore[arg-type]
        )

    def _engine(
        self,
        assistant_model: Any,
        prompt_lookup: int | None,
        num_assistant_tokens: int | None,
        config: transformers.GenerationConfig,
    ) -> LLM:
        """The engine for this call's drafter. Engines share the native model and are kept for
        later calls (their KV pools take memory only where written), the least recently used
        let go past ``MAX_ENGINES``."""
        if assistant_model is not None and prompt_lookup is not None:
            raise ValueError("give assistant_model or prompt_lookup_num_tokens, not both")
        speculative: SpecConfig | None = self.speculative
        key: tuple[Any, ...] = ("default",)
        if assistant_model is not None:
            check_placement(assistant_model)
            k, adaptive = 8, True  # the engine's default: up to 8 drafts, as they pay
            if num_assistant_tokens is not None:  # transformers' schedule, if asked for
                k = num_assistant_tokens
                adaptive = config.num_assistant_tokens_schedule not in (None, "constant")
            speculative = SpecConfig("draft_model", k, adaptive, draft_model=assistant_model)
            key = ("draft_model", assistant_model, k, adaptive)  # holds it: no id reuse
        elif prompt_lookup is not None:
            ngram = config.max_matching_ngram_size or 2  # transformers' default
            speculative = SpecConfig(
                "prompt_lookup", prompt_lookup, prompt_lookup_min=1, prompt_lookup_max=ngram
            )
            key = ("prompt_lookup", prompt_lookup, ngram)
        llm = self._engines.pop(key, None)
        if llm is None:
            while len(self._engines) >= MAX_ENGINES:
                self._engines.pop(next(iter(self._engines)))
            llm = LLM.on_native_model(
                self.checkpoint, self.native, speculative, **self.engine_options
            )
        self._engines[key] = self._llm = llm
        return llm


def check_placement(model: Any) -> None:
    """Refuse, with the reason, a model the CPU engine cannot run on its own storage."""
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"wrap takes a transformers model, got {type(model).__name__}")
    check_architecture(model.config)
    device_map = getattr(model, "hf_device_map", None) or {}
    placed = {str(d) for d in device_map.values()} - {"cpu"}
    if placed:
        raise ValueError(
            f"the model is dispatched by accelerate across {sorted(placed)} (hf_device_map); "
            "specdec.wrap runs a model held whole in CPU memory: load it without device_map"
        )
    if model.device.type != "cpu":
        raise ValueError(
            f"the model is on {model.device}: specdec.wrap runs on the CPU for now (the CUDA "
            "engine is a later release); move it with model.to('cpu')"
        )
    if model.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"the model's weights are {model.dtype}: the CPU engine runs float32 or bfloat16; "
            "convert with model.float() or model.to(torch.bfloat16)"
        )


def fuse_projections(model: transformers.PreTrainedModel) -> None:
    """Give each decoder layer's q/k/v projections, and its gate/up projections, one storage.

    The native model multiplies by fused ``[q; k; v]`` and ``[gate; up]`` matrices. Rather than
    concatenating copies, the transformers parameters are moved into one fused tensor each
    (their values and identities unchanged, their storage now row blocks of it), so the native
    model's fused weight is a view of the same memory (:func:`specdec.models.llama.concat_rows`).
    """
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        _fuse_rows([attention.q_proj, attention.k_proj, attention.v_proj])
        _fuse_rows([mlp.gate_proj, mlp.up_proj])


def _fuse_rows(linears: list[nn.Linear]) -> None:
    for name in ("weight", "bias"):
        params = [getattr(linear, name) for linear in linears]
        if any(p is None for p in params) or rows_adjacent([p.detach() for p in params]):
            continue  # no such parameters, or fused already (a second wrap of the model)
        fused = torch.cat([p.detach() for p in params], dim=0)  # [sum of out_features, ...]
        start = 0
        for p in params:
            p.data = fused[start : start + p.shape[0]]
            start += p.shape[0]


def _stream(
    llm: LLM,
    prompt: list[int],
    params: SamplingParams,
    input_ids: torch.Tensor,
    streamer: Any,
    criteria: list[Any],
) -> RequestOutput:
    """One row, its tokens handed to ``streamer`` as they come: first the input ids, then each
    step's new tokens, then ``end()``, as transformers' ``generate`` calls it."""
    streamer.put(input_ids.cpu())
    total = RequestOutput(-1, prompt)
    try:
        for delta in llm.stream(prompt, params):
            if delta.token_ids:
                start = len(total.token_ids)
                merge_delta(total, delta)
                stop = hf.first_stop(criteria, total, start)
                streamer.put(torch.tensor(total.token_ids[start:stop]))
                if stop is not None:
                    hf.cut_output(total, stop)
                    break  # closing the stream aborts the request
    finally:
        streamer.end()
    return total
