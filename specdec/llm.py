"""The public entry point, shaped like vLLM's ``LLM`` so that users already know it."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from specdec.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from specdec.chat_render import ChatOptions, Conversation, render_chat
from specdec.config import SamplingParams
from specdec.drafters.registry import SpecConfig
from specdec.engine import Engine
from specdec.engine_config import EngineConfig, resolve_device
from specdec.generation_defaults import sampling_defaults
from specdec.loader import (
    LoadedCheckpoint,
    load_checkpoint,
    prequantized_weights,
    resolve_dtype,
)
from specdec.lora import LoRARequest
from specdec.models.llama import LlamaForCausalLM
from specdec.models.quant import check_quantization
from specdec.outputs import RequestOutput, merge_delta
from specdec.pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
from specdec.prompt_inputs import (
    Job,
    Prompt,
    as_prompt_list,
    completion_params,
    dict_prompt,
    loras_for,
    params_for,
    priorities_for,
    to_token_ids,
)
from specdec.scoring import ScoringRequestOutput, score_pairs, scoring_outputs


class LLM:
    """A target model on the specdec engine.

    ``model`` is ``None`` (the embedded SmolLM2-135M-Instruct), a local Hugging Face directory, a
    GGUF file, or an in-memory ``transformers`` model. ``dtype`` (``"float32"``, ``"bfloat16"``
    or ``"auto"``, the model's own) is the activations' dtype and that of every unquantized
    weight; ``quantization`` (``"int8"``, ``"int4"``, ``"w8a8"``, ``"w4a8"`` or ``None``) runs
    the linears on quantized weights, weight-only or (``w*a8``) with int8 activations too (see
    :mod:`specdec.models.quant`; a GGUF file's Q4_1 and Q8_0 tensors are used as they are).
    Engine options are the fields of :class:`~specdec.engine_config.EngineConfig`
    (``max_num_seqs``, ``num_kv_blocks``, ``seed``, ...); ``speculative_config`` takes vLLM's dictionary instead of
    ``speculative`` (see :meth:`SpecConfig.from_vllm`). ``generation_config`` (``"auto"``, the
    model's generation config; ``"vllm"``, none; or a directory) and
    ``override_generation_config`` set the default sampling parameters, as vLLM's options do
    (see :mod:`specdec.generation_defaults`).

    >>> llm = LLM()
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0))[0].text
    """

    def __init__(
        self,
        model: str | os.PathLike | Any | None = None,
        tokenizer: Any = None,
        dtype: str | Any = "float32",
        speculative: SpecConfig | dict | None = None,
        quantization: str | None = None,
        *,
        speculative_config: dict[str, Any] | None = None,
        generation_config: str | os.PathLike = "auto",
        override_generation_config: dict[str, Any] | None = None,
        **engine_options: Any,
    ):
        if speculative_config is not None:
            if speculative is not None:
                raise ValueError("give speculative or vLLM's speculative_config, not both")
            speculative = SpecConfig.from_vllm(speculative_config)
        config = EngineConfig.from_options(engine_options)
        resolved = resolve_dtype(dtype, model)
        quantization = check_quantization(quantization)
        checkpoint = load_checkpoint(model, tokenizer, resolved)
        model_impl = LlamaForCausalLM.from_hf(
            checkpoint.config,
            checkpoint.state_dict,
            config.max_model_len or checkpoint.config.max_position_embeddings,
            config.batch_invariant,
            quantization,
            prequantized_weights(checkpoint) if quantization else None,
            device=resolve_device(config.device),
        )
        self._assemble(checkpoint, model_impl, resolved, config, speculative, quantization)
        source, override = generation_config, override_generation_config
        self.sampling_defaults = sampling_defaults(source, checkpoint.generation_config, override)

    @classmethod
    def on_native_model(
        cls,
        checkpoint: LoadedCheckpoint,
        model: LlamaForCausalLM,
        speculative: SpecConfig | dict | None = None,
        **engine_options: Any,
    ) -> LLM:
        """An engine on a native model already built from ``checkpoint`` (``specdec.wrap``
        builds one per drafter around the same weights)."""
        llm = cls.__new__(cls)
        config = EngineConfig.from_options(engine_options)
        dtype = model.embed_tokens.weight.dtype
        llm._assemble(checkpoint, model, dtype, config, speculative, None)
        return llm

    def _assemble(
        self,
        checkpoint: LoadedCheckpoint,
        model: LlamaForCausalLM,
        dtype: torch.dtype,
        config: EngineConfig,
        speculative: SpecConfig | dict | None,
        quantization: str | None,
    ) -> None:
        self.dtype, self.quantization = dtype, quantization
        self.model_name = checkpoint.name
        self.tokenizer = checkpoint.tokenizer
        max_model_len = config.max_model_len or checkpoint.config.max_position_embeddings
        self.spec_config = SpecConfig.coerce(speculative)
        # SamplingParams fields the model's generation config sets (specdec.generation_defaults)
        self.sampling_defaults = sampling_defaults("auto", checkpoint.generation_config)
        self._streams: dict[int, list[RequestOutput]] = {}  # open streams' undelivered deltas
        self.engine = Engine(
            model, self.tokenizer, config, dtype, max_model_len, self.spec_config, checkpoint
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for each prompt (text, token ids, or vLLM's `{"prompt": ...}` /
        `{"prompt_token_ids": ...}` dictionaries; no chat template), with one
        ``SamplingParams`` for all or one per prompt; ``use_tqdm`` shows a progress bar of
        finished requests, as vLLM's does. With ``n > 1`` a prompt's output holds its first
        completion and ``more_completions`` the rest (``outputs`` lists them all).
        ``priority``: one per prompt, lower first, under ``scheduling_policy="priority"``.
        ``lora_request``: the LoRA adapter to run through, for all or per prompt (see
        :mod:`specdec.lora`; the engine needs ``enable_lora=True``)."""
        prompt_list = as_prompt_list(prompts)
        sampling_params = sampling_params or self.get_default_sampling_params()
        param_list = params_for(sampling_params, SamplingParams, len(prompt_list))
        ranks = priorities_for(priority, prompt_list)
        loras = loras_for(lora_request, len(prompt_list))
        jobs: list[Job] = []
        for prompt, sp, rank, lora in zip(prompt_list, param_list, ranks, loras):
            text, ids = self._text_and_ids(prompt)
            jobs += [
                Job(ids, completion_params(sp, choice), rank, text, lora) for choice in range(sp.n)
            ]
        outputs = iter(self._run(jobs, use_tqdm))
        firsts = []
        for sp in param_list:  # a prompt's completions are consecutive
            firsts.append(next(outputs))
            firsts[-1].more_completions = [next(outputs) for _ in range(sp.n - 1)]
        return firsts

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding: its final hidden states pooled as the engine's
        ``pooling_type`` says (the last token's by default) and, unless ``normalize=False``,
        scaled to unit length (vLLM's ``LLM.embed``; see :mod:`specdec.pooling`).
        ``truncate_prompt_tokens`` keeps each prompt's last k tokens (-1: as many as fit)."""
        prompt_list = as_prompt_list(prompts)
        pooling_list = params_for(pooling_params, PoolingParams, len(prompt_list))
        if truncate_prompt_tokens is not None:
            pooling_list = [
                replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in pooling_list
            ]
        jobs, ranks = [], priorities_for(priority, prompt_list)
        loras = loras_for(lora_request, len(ranks))
        for prompt, pp, rank, lora in zip(prompt_list, pooling_list, ranks, loras):
            text, ids = self._text_and_ids(prompt)
            jobs.append(Job(ids, pp, rank, text, lora))
        return [
            EmbeddingRequestOutput(
                out.request_id,
                out.prompt_token_ids,
                EmbeddingOutput(out.embedding.tolist()),  # type: ignore[union-attr]
                prompt=out.prompt,
            )
            for out in self._run(jobs, use_tqdm)
        ]

    def score(
        self,
        data_1: Prompt | Sequence[Prompt],
        data_2: Prompt | Sequence[Prompt],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """The cosine similarity of each pair's embeddings (vLLM's ``LLM.score`` for an embedding
        model): one ``data_1`` against every ``data_2``, or lists of equal length pair by pair
        (see :mod:`specdec.scoring`). Every input is embedded once, all in one batch."""
        firsts, seconds = as_prompt_list(data_1), as_prompt_list(data_2)
        score_pairs(len(firsts), len(seconds))  # refuse a bad pairing before running anything
        embedded = self.embed(
            firsts + seconds, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm, lora_request=lora_request,
        )  # fmt: skip
        return scoring_outputs(embedded[: len(firsts)], embedded[len(firsts) :])

    def _run(self, jobs: list[Job], use_tqdm: bool) -> list[RequestOutput]:
        """Add ``jobs`` to the engine and step until they have finished; their outputs, in
        order. ``use_tqdm`` shows a progress bar of finished requests, as vLLM's does."""
        results: dict[int, RequestOutput] = {}
        progress = tqdm(total=len(jobs), disable=not use_tqdm)
        try:  # on any error (a bad prompt, Ctrl-C), abort what was queued: nothing is left behind
            for job in jobs:
                request_id = self.engine.add_request(
                    job.token_ids, job.params, job.priority, job.lora
                )
                results[request_id] = RequestOutput(request_id, job.token_ids, prompt=job.text)
            unfinished = len(results)
            while unfinished and self.engine.has_unfinished():  # open streams advance too
                for delta in self._step():
                    if delta.request_id in results:
                        merge_delta(results[delta.request_id], delta)
                        progress.update(int(delta.finished))
                        unfinished -= int(delta.finished)
        except BaseException:
            for request_id in results:
                self.engine.abort(request_id)
            raise
        finally:
            progress.close()
        return list(results.values())

    def _text_and_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A prompt's text (where given as text) and token ids."""
        if isinstance(prompt, dict):
            prompt = dict_prompt(prompt)
        return (prompt if isinstance(prompt, str) else None), self.encode(prompt)

    def chat(
        self,
        conversations: Conversation | list[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[Any] | None = None,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply for each conversation, through the tokenizer's chat template, or
        ``chat_template`` (a Jinja template) instead (see :meth:`render_chat` for the options;
        ``tools``: function definitions for templates that render them, as vLLM's ``LLM.chat``
        takes them)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item, arg-type]
        options = ChatOptions(
            add_generation_prompt, continue_final_message, chat_template_kwargs, tools,
            chat_template,
        )  # fmt: skip
        prompts = [self.render_chat(c, options) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """Each prompt's ``params.beam_width`` best continuations by beam search (vLLM's
        ``LLM.beam_search``; see :mod:`specdec.beam_search`), best first."""
        encoded = [self.encode(p) for p in as_prompt_list(prompts)]
        return beam_search(self, encoded, params, lora_request)

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield deltas (new tokens and text) of one request as they are produced.

        Other requests already queued on the engine advance in the same steps; streams may be
        read in turns, and beside ``generate`` or ``embed`` calls, none losing a delta. Closing
        the iterator early aborts the request and frees its KV blocks.
        """
        params = sampling_params or self.get_default_sampling_params()
        if params.n != 1:
            raise ValueError(f"stream gives one completion: n must be 1, got {params.n}")
        request_id = self.engine.add_request(self.encode(prompt), params, 0, lora_request)
        queued = self._streams[request_id] = []
        try:
            while queued or self.engine.has_unfinished():
                while queued:
                    delta = queued.pop(0)
                    yield delta
                    if delta.finished:
                        return
                self._step()  # this stream's deltas land in queued
        finally:
            del self._streams[request_id]
            self.engine.abort(request_id)

    def _step(self) -> list[RequestOutput]:
        """One engine step: the deltas of open streams are queued for them (whichever call
        steps the engine), the others returned."""
        others: list[RequestOutput] = []
        for delta in self.engine.step():
            queue = self._streams.get(delta.request_id)
            (others if queue is None else queue).append(delta)
        return others

    def apply_chat_template(
        self, conversation: Conversation, options: ChatOptions | None = None
    ) -> list[int]:
        """The prompt token ids of ``conversation`` (by default with the assistant's turn
        opened)."""
        return self.encode(self.render_chat(conversation, options))

    def render_chat(self, conversation: Conversation, options: ChatOptions | None = None) -> str:
        """The prompt text of ``conversation`` through the tokenizer's chat template (see
        :func:`specdec.chat_render.render_chat`)."""
        return render_chat(self.tokenizer, conversation, options)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate``, ``chat`` and ``stream`` take without parameters (vLLM's method):
        the generation config's sampling fields (:mod:`specdec.generation_defaults`)."""
        return SamplingParams(**self.sampling_defaults)

    def reset_prefix_cache(self) -> bool:
        """Forget the cached blocks no request holds (vLLM's; for benchmarks that replay)."""
        self.engine.scheduler.block_manager.reset_prefix_cache()
        return True

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The target's tokenizer (vLLM's ``LLM.get_tokenizer``)."""
        return self.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """The token ids of ``prompt`` (text is tokenized without special tokens); anything
        that is not a :data:`Prompt` raises a TypeError that says what was given."""
        if isinstance(prompt, dict):
            prompt = dict_prompt(prompt)
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return to_token_ids(prompt)

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens kept (the inverse of :meth:`encode`)."""
        return str(self.tokenizer.decode(token_ids))
