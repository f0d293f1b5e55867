"""The public entry point, shaped like vLLM's ``LLM`` so that users already know it."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from specdec.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from specdec.config import SamplingParams, choice_seed
from specdec.drafters.registry import SpecConfig
from specdec.engine import Engine
from specdec.engine_config import EngineConfig, resolve_device
from specdec.loader import (
    LoadedCheckpoint,
    load_checkpoint,
    prequantized_weights,
    resolve_dtype,
)
from specdec.models.llama import LlamaForCausalLM
from specdec.models.quant import check_quantization
from specdec.outputs import RequestOutput

# Raw text, token ids, or vLLM's prompt dictionaries: {"prompt": text} (TextPrompt) or
# {"prompt_token_ids": ids} (TokensPrompt)
Prompt = str | list[int] | dict[str, Any]
Conversation = list[dict[str, str]]
# apply_chat_template's own arguments, which template variables must not override
CHAT_TEMPLATE_ARGUMENTS = frozenset(
    inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
) - {"self", "kwargs"}


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a conversation is rendered into a prompt (vLLM's chat request fields)."""

    add_generation_prompt: bool = True  # open the assistant's turn after the last message
    continue_final_message: bool = False  # or leave the final message open, to be continued
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    tools: list[Any] | None = None  # functions the model may call (OpenAI's format)
    chat_template: str | None = None  # a Jinja template instead of the tokenizer's own


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
    ``speculative`` (see :meth:`SpecConfig.from_vllm`).

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
        **engine_options: Any,
    ):
        if speculative_config is not None:
            if speculative is not None:
                raise ValueError("give speculative or vLLM's speculative_config, not both")
            speculative = SpecConfig.from_vllm(speculative_config)
        config = engine_config(engine_options)
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
        config = engine_config(engine_options)
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
    ) -> list[RequestOutput]:
        """Generate a completion for each prompt (text, token ids, or vLLM's `{"prompt": ...}` /
        `{"prompt_token_ids": ...}` dictionaries; no chat template), with one
        ``SamplingParams`` for all or one per prompt; ``use_tqdm`` shows a progress bar of
        finished requests, as vLLM's does. With ``n > 1`` a prompt's output holds its first
        completion and ``more_completions`` the rest (``outputs`` lists them all).
        ``priority``: one per prompt, lower first, under ``scheduling_policy="priority"``."""
        prompt_list: list[Prompt] = (
            [prompts] if _is_single(prompts) else list(prompts)  # type: ignore[list-item, arg-type]
        )
        param_list = self._params_for(sampling_params, len(prompt_list))
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        ids: list[list[int]] = []  # per prompt, its completions' request ids
        results: dict[int, RequestOutput] = {}
        progress = tqdm(total=sum(p.n for p in param_list), disable=not use_tqdm)
        try:  # on any error (a bad prompt, Ctrl-C), abort what was queued: nothing is left behind
            for prompt, sp, rank in zip(prompt_list, param_list, priorities, strict=True):
                ids.append([])
                if isinstance(prompt, dict):
                    prompt = _dict_prompt(prompt)
                text, token_ids = prompt if isinstance(prompt, str) else None, self.encode(prompt)
                for choice in range(sp.n):
                    completion = _completion(sp, choice)
                    ids[-1].append(self.engine.add_request(token_ids, completion, rank))
                    results[ids[-1][-1]] = RequestOutput(ids[-1][-1], token_ids, prompt=text)
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    merge_delta(results[delta.request_id], delta)
                    progress.update(int(delta.finished))
        except BaseException:
            for i in results:
                self.engine.abort(i)
            raise
        finally:
            progress.close()
        for choices in ids:
            results[choices[0]].more_completions = [results[i] for i in choices[1:]]
        return [results[choices[0]] for choices in ids]

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
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Each prompt's ``params.beam_width`` best continuations by beam search (vLLM's
        ``LLM.beam_search``; see :mod:`specdec.beam_search`), best first."""
        prompt_list: list[Prompt] = (
            [prompts] if _is_single(prompts) else list(prompts)  # type: ignore[list-item, arg-type]
        )
        encoded = [self.encode(p) for p in prompt_list]
        return beam_search(self, encoded, params)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield deltas (new tokens and text) of one request as they are produced.

        Other requests already queued on the engine advance in the same steps. Closing the
        iterator early aborts the request and frees its KV blocks.
        """
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"stream gives one completion: n must be 1, got {params.n}")
        request_id = self._add(prompt, params)
        try:
            while request_id in self.engine.requests:
                for delta in self.engine.step():
                    if delta.request_id == request_id:
                        yield delta
        finally:
            self.engine.abort(request_id)

    def apply_chat_template(
        self, conversation: Conversation, options: ChatOptions | None = None
    ) -> list[int]:
        """The prompt token ids of ``conversation`` (by default with the assistant's turn
        opened)."""
        return self.encode(self.render_chat(conversation, options))

    def render_chat(self, conversation: Conversation, options: ChatOptions | None = None) -> str:
        """The prompt text of ``conversation`` through the tokenizer's chat template.

        ``options`` (:class:`ChatOptions`, as vLLM's chat fields): open the assistant's turn (the
        default), or continue the final message instead (a reply started for the model), and
        extra variables for the template. Raises ``ValueError`` for an empty conversation, both
        options at once, or template variables that name the template's own arguments.
        """
        options = options or ChatOptions()
        if not conversation:
            raise ValueError("conversation is empty: give at least one message")
        if options.add_generation_prompt and options.continue_final_message:
            raise ValueError(
                "add_generation_prompt and continue_final_message cannot both be true: open a "
                "new assistant turn, or continue the final message"
            )
        kwargs = dict(options.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & CHAT_TEMPLATE_ARGUMENTS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        text = self.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            tools=options.tools,
            chat_template=options.chat_template,
            tokenize=False,
            **kwargs,
        )
        assert isinstance(text, str)
        return text

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The target's tokenizer (vLLM's ``LLM.get_tokenizer``)."""
        return self.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """The token ids of ``prompt`` (text is tokenized without special tokens); anything
        that is not a :data:`Prompt` raises a TypeError that says what was given."""
        if isinstance(prompt, dict):
            prompt = _dict_prompt(prompt)
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return _token_ids(prompt)

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens kept (the inverse of :meth:`encode`)."""
        return str(self.tokenizer.decode(token_ids))

    def _add(self, prompt: Prompt, params: SamplingParams) -> int:
        return self.engine.add_request(self.encode(prompt), params)

    @staticmethod
    def _params_for(
        params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return list(params)


def engine_config(options: dict[str, Any]) -> EngineConfig:
    """The :class:`EngineConfig` of ``LLM``'s keyword options; an unknown one (vLLM has many
    that mean nothing here) raises a TypeError that names it and lists the known ones."""
    known = [f.name for f in dataclasses.fields(EngineConfig)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(
            f"LLM got unknown option(s) {', '.join(map(repr, unknown))}; its engine options are "
            f"{', '.join(known)}"
        )
    return EngineConfig(**options)


def _is_single(prompts: Any) -> bool:
    if isinstance(prompts, torch.Tensor | np.ndarray):
        return prompts.ndim == 1
    return isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int | np.integer)
    )


def _completion(params: SamplingParams, choice: int) -> SamplingParams:
    """The parameters of completion ``choice`` of ``params.n`` (see ``choice_seed``); a copy,
    so that validation does not rerun."""
    if params.n == 1:
        return params
    one = copy.copy(params)
    one.n, one.seed = 1, choice_seed(params.seed, choice)
    return one


def _dict_prompt(prompt: dict[str, Any]) -> str | list[int]:
    """The text or token ids of vLLM's ``TextPrompt`` / ``TokensPrompt`` dictionaries."""
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return str(prompt["prompt"])
    if keys == {"prompt_token_ids"}:
        return _token_ids(prompt["prompt_token_ids"])
    raise TypeError(
        'a prompt dictionary takes one key, "prompt" (text) or "prompt_token_ids" (token ids); '
        f"got keys {', '.join(sorted(map(repr, keys)))}"
    )


def _token_ids(prompt: Any) -> list[int]:
    """``prompt`` as a list of Python ints, from a sequence (or 1-D array) of integers."""
    if isinstance(prompt, torch.Tensor | np.ndarray):
        if prompt.ndim != 1:
            raise TypeError(f"token ids must be 1-D, got an array of shape {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
        raise TypeError(
            "a prompt is text, a list of token ids or a dict with 'prompt' or "
            f"'prompt_token_ids', not {type(prompt).__name__}"
        )
    ids = list(prompt)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise TypeError(f"token ids must be integers, got {type(t).__name__} ({t!r})")
    return [int(t) for t in ids]


def merge_delta(total: RequestOutput, delta: RequestOutput) -> None:
    total.prompt_token_ids = delta.prompt_token_ids  # the engine's: truncated, where asked
    total.token_ids += delta.token_ids
    total.text += delta.text
    if delta.logits is not None:
        parts = [delta.logits] if total.logits is None else [total.logits, delta.logits]
        total.logits = torch.cat(parts)
    if delta.hidden_states is not None:
        states = delta.hidden_states
        if total.hidden_states is not None:
            states = torch.cat([total.hidden_states, states], dim=1)
        total.hidden_states = states
    if delta.attentions is not None:
        total.attentions = [*(total.attentions or []), *delta.attentions]
    if delta.logprobs is not None:
        total.logprobs = total.logprobs if total.logprobs is not None else []
        total.logprobs.extend(delta.logprobs)
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    total.finished, total.finish_reason, total.metrics = (
        delta.finished,
        delta.finish_reason,
        delta.metrics,
    )
