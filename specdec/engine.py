"""The engine: requests in, a step loop, tokens out.

``Engine.step`` is the whole decoding loop (see the README's Architecture section): schedule,
one forward, verify, update, draft. Everything a request owns lives on its :class:`Sequence`; the KV
memory is the runner's; the block ids are the scheduler's block manager's.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from typing import Any

import torch

from specdec.config import SamplingParams
from specdec.detokenizer import Detokenizer
from specdec.drafters.base import Drafter, FinishedStep
from specdec.drafters.policy import AdaptivePolicy
from specdec.drafters.registry import SpecConfig, build_speculation
from specdec.engine_config import EngineConfig
from specdec.loader import LoadedCheckpoint, end_of_sequence_ids
from specdec.lora import LoRARequest, lora_manager
from specdec.models.llama import LlamaForCausalLM
from specdec.outputs import RequestOutput, TokenLogprobs
from specdec.pooling import Pooler, PoolingParams
from specdec.runner import KeptLayers, ModelRunner, StepResult, kv_block_bytes
from specdec.scheduler import Scheduler, SchedulerOutput
from specdec.sequence import Sequence
from specdec.structured.guide import GuideFactory
from specdec.verifier import Verifier
from specdec.verify import select_backend

logger = logging.getLogger(__name__)

# CUDA: memory kept free for a step's activations and the allocator's slack when the KV pool is
# sized (the largest step of the default budget, 1,024 tokens, needs a few hundred MB at most).
ACTIVATION_RESERVE_BYTES = 1 << 30


class Engine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer,  # noqa: ANN001
        config: EngineConfig,
        dtype: torch.dtype,
        max_model_len: int,
        speculative: SpecConfig | None = None,
        target: LoadedCheckpoint | None = None,
    ):
        """``speculative``: the drafter to build for this engine (None: plain decoding);
        ``target``: the checkpoint ``model`` was built from, for drafters made from it."""
        self.config = config
        self.tokenizer = tokenizer
        self.device = model.embed_tokens.weight.device  # the engine runs where the weights are
        block_bytes = kv_block_bytes(model, config.block_size, dtype)
        if config.num_kv_blocks:
            num_blocks = config.num_kv_blocks
        elif self.device.type == "cuda":
            num_blocks = cuda_kv_blocks(self.device, config, block_bytes)
        else:
            num_blocks = max(1, int(config.kv_cache_memory_gb * 2**30) // block_bytes)
        # A lone sequence must always fit, so that preemption can always make progress.
        self.max_model_len = min(max_model_len, num_blocks * config.block_size)
        self.vocab_size = model.config.vocab_size
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len)
        self.runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            dtype,
            cuda_graphs=config.cuda_graphs,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
        )
        self.verifier = Verifier(select_backend(None, self.device))
        self.detokenizer = Detokenizer(tokenizer)
        self.eos_token_ids = end_of_sequence_ids(tokenizer, target)
        self.guides = GuideFactory(tokenizer, self.vocab_size, self.eos_token_ids)
        self.requests: dict[int, Sequence] = {}
        self._ids = itertools.count()
        self._seeds = None if config.seed is None else torch.Generator().manual_seed(config.seed)
        self.loras = lora_manager(model, config)  # None without enable_lora
        self.drafter: Drafter | None = None
        self.policy: AdaptivePolicy | None = None
        if speculative is not None:
            self.drafter, self.policy = build_speculation(speculative, self, target)
        if self.loras is not None:  # a quantized_self draft runs each request's adapter too
            self.loras.follow(getattr(self.drafter, "adapter_model", None))

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> int:
        """Queue a request; bad prompts raise ``ValueError`` before anything is allocated.
        ``params``: how to sample, or, as in vLLM, ``PoolingParams`` for an embedding request
        (its final output carries the pooled prompt states, see :mod:`specdec.pooling`).
        ``priority``: under the ``"priority"`` scheduling policy, lower runs first (any integer;
        the ``"fcfs"`` policy takes 0 only, as vLLM's). ``lora_request``: the LoRA adapter to
        run it through (see :mod:`specdec.lora`), loaded on first use."""
        check_priority(priority, self.scheduler.by_priority)
        pooling = params if isinstance(params, PoolingParams) else None
        if pooling is not None:
            params = pooling.sampling_params()
        assert isinstance(params, SamplingParams)
        if params.truncate_prompt_tokens is not None:  # the last k tokens
            keep = self.prompt_limit(params.truncate_prompt_tokens)
            prompt_token_ids = list(prompt_token_ids)[-keep:]
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: give at least one token")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens, but the context holds at most "
                f"{self.max_model_len} (prompt + output): shorten the prompt, or keep its last "
                "tokens with truncate_prompt_tokens"
            )
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        bos = params.forced_bos_token_id
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or {}),
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("suppress_tokens", params.suppress_tokens or []),
            ("bad_words_ids", [t for word in params.bad_words_ids or [] for t in word]),
            ("begin_suppress_tokens", params.begin_suppress_tokens or []),
            ("sequence_bias", [t for key in params.sequence_bias or {} for t in key]),
            ("forced_bos_token_id", [] if bos is None else [bos]),
            ("forced_eos_token_id", params.forced_eos_ids),
        ):
            if any(t >= self.vocab_size for t in ids):  # SamplingParams refused negative ones
                raise ValueError(f"{name} token ids must lie in [0, {self.vocab_size})")
        lora_key = self._lora_key(lora_request)  # last: loading may let another adapter go
        seq = Sequence(
            next(self._ids),
            list(prompt_token_ids),
            n,
            params,
            self.eos_token_ids,
            seeds=self._seeds,
            priority=priority,
            lora_key=lora_key,
        )
        seq.guide = self.guides.for_params(params)
        if pooling is not None:
            normalize = pooling.normalize is not False
            seq.pooler = Pooler(self.config.pooling_type, normalize, n)
        seq.bad_word_ids = bad_word_token_ids(self.tokenizer, params.bad_words or [])
        self.requests[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def _lora_key(self, request: LoRARequest | None) -> int:
        if request is None:
            return 0
        if self.loras is None:
            raise ValueError(
                f"LoRA adapter {request.name!r} asked for, but LoRA is not enabled: pass "
                "enable_lora=True (--enable-lora)"
            )
        return self.loras.acquire(request, self._loras_in_use())

    def add_lora(self, request: LoRARequest) -> bool:
        """Load an adapter before any request asks for it (vLLM's ``add_lora``)."""
        return self._lora_key(request) > 0

    def remove_lora(self, lora_int_id: int) -> bool:
        """Let go of a loaded adapter (False: none has that id); refused while requests use it."""
        return self.loras is not None and self.loras.remove(lora_int_id, self._loras_in_use())

    def _loras_in_use(self) -> set[int]:
        return {seq.lora_key for seq in self.requests.values()}

    def list_loras(self) -> set[int]:
        """The ids of the loaded adapters."""
        return set() if self.loras is None else set(self.loras.loaded)

    def prompt_limit(self, truncate_prompt_tokens: int) -> int:
        """How many of a prompt's last tokens ``truncate_prompt_tokens`` keeps (-1: room for
        one new token; see :class:`~specdec.config.SamplingParams`)."""
        return self.max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens

    def abort(self, request_id: int) -> None:
        """Stop a request now and free its KV blocks (unknown or finished ids are ignored)."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")
            if self.drafter is not None and self.policy is not None:
                self.drafter.forget(seq)
                self.policy.forget(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.block_manager.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.scheduler.block_manager.num_blocks

    def step(self) -> list[RequestOutput]:
        """Run one step; return a delta for every request that produced output."""
        out = self.scheduler.schedule()
        if not out.seqs:
            return []
        start = time.perf_counter()
        hidden = self.drafter is not None and self.drafter.needs_token_hidden_states
        pools = any(seq.pooler is not None for seq in out.seqs)
        try:
            res = self.runner.run(out, keep_token_hidden_states=hidden or pools)
            if out.copies:  # and a drafter's own K/V by block (EAGLE's)
                copy = getattr(self.drafter, "copy_blocks", None)
                if copy is not None:
                    copy(out.copies)
        finally:  # the copies' sources are held until the copies are made
            self.scheduler.block_manager.release_copies(out.copies)
        for i, lps in res.prompt_logprobs.items():
            out.seqs[i].prompt_logprobs += lps
        if pools:
            take_pooled_states(out, res)
        verification = self.verifier.verify(out, res)
        if self.policy is not None and out.total_tokens == len(res.logits):  # decode/verify only
            padded = len(out.seqs) * max(out.num_scheduled_tokens)  # attention pads to this
            self.policy.observe_step(padded, time.perf_counter() - start)
        updated = self.scheduler.update(out, verification.emitted)
        for i, kept in res.layer_outputs.items():  # rejected drafts' go in _delta
            keep_layer_outputs(out.seqs[i], kept)
        logits = {seq.seq_id: rows for seq, rows in zip(out.seqs, verification.logits)}
        logprobs = {seq.seq_id: lps for seq, lps in zip(out.seqs, verification.logprobs)}
        deltas = [
            self._delta(seq, logits.get(seq.seq_id), logprobs.get(seq.seq_id)) for seq in updated
        ]
        self._propose(FinishedStep(out, res, verification))
        return deltas

    def _propose(self, step: FinishedStep) -> None:
        """Let the drafter propose the next step's drafts for every running sequence."""
        if self.drafter is None or self.policy is None:
            return
        out, drafter, policy = step.scheduled, self.drafter, self.policy
        policy.observe_verification(
            out.seqs, step.verification.num_drafts, step.verification.num_accepted
        )
        for seq in out.preempted + [s for s in out.seqs if s.is_finished]:
            drafter.forget(seq)
            policy.forget(seq)
        running = self.scheduler.running
        ks = policy.num_drafts(
            running,
            self.max_model_len,
            drafter.draft_class,
            drafter.catch_up_tokens,
            getattr(drafter, "runs_model", None),
        )
        start = time.perf_counter()
        drafter.propose(running, ks, step)
        policy.observe_drafting(ks, time.perf_counter() - start)
        for seq in running:  # drafts a guide forbids (prompt lookup's) are not worth verifying
            if seq.guide is not None and seq.spec_token_ids:
                del seq.spec_token_ids[seq.guided_drafts() :]

    def _delta(
        self,
        seq: Sequence,
        logits: torch.Tensor | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        """The text and tokens ``seq`` gained since its previous delta; ``logits`` and
        ``logprobs``: those of this step's emitted tokens, of which the kept ones are handed
        back (a stop ends a step's tokens early)."""
        text = self.detokenizer.step(seq, self.scheduler) if seq.params.detokenize else ""
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None and seq.num_returned_tokens == 0:
            prompt_logprobs = [None, *seq.prompt_logprobs]  # the first delta carries them
        new_tokens = seq.output_token_ids[seq.num_returned_tokens :]
        if seq.pooler is not None:  # an embedding: the token sampled after its prompt is dropped
            new_tokens = []
        hidden, attentions = _take_layer_outputs(seq) if seq.params.keeps_layers else (None, None)
        embedding = None
        if seq.pooler is not None and seq.is_finished and seq.pooler.done:
            embedding = seq.pooler.result()
        seq.num_returned_tokens = seq.num_output_tokens
        if seq.is_finished:
            self.requests.pop(seq.seq_id, None)
        return RequestOutput(
            seq.seq_id,
            seq.prompt_token_ids,
            new_tokens,
            text,
            seq.is_finished,
            seq.finish_reason,
            seq.metrics,
            None if logits is None else logits[: len(new_tokens)],
            None if logprobs is None else logprobs[: len(new_tokens)],
            prompt_logprobs,
            hidden_states=hidden,
            attentions=attentions,
            embedding=embedding,
        )


def check_priority(priority: Any, by_priority: bool) -> None:  # noqa: ANN401
    """Refuse a priority that is not an integer, or not 0 without the priority policy."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and not by_priority:
        raise ValueError(
            f"got priority {priority}, but the engine schedules first come first served: build "
            "it with scheduling_policy='priority' (specdec serve --scheduling-policy priority)"
        )


def take_pooled_states(out: SchedulerOutput, res: StepResult) -> None:
    """Hand each pooling sequence of the step its query positions' final states."""
    assert res.token_hidden_states is not None
    row = 0
    for seq, n in zip(out.seqs, out.num_scheduled_tokens):
        if seq.pooler is not None:
            seq.pooler.take(res.token_hidden_states[row : row + n], seq.num_computed_tokens)
        row += n


def keep_layer_outputs(seq: Sequence, kept: KeptLayers) -> None:
    """Add a step's per-layer outputs to those ``seq`` hands back with its next delta."""
    n = kept.states.shape[1]
    if seq.params.return_hidden_states:
        seq.hidden_states.append(kept.states)
    if kept.attentions is not None:  # per position p, its row over positions 0 .. p
        rows = kept.attentions.unbind(dim=2)
        seq.attentions += [row[..., : kept.first + j + 1] for j, row in enumerate(rows)]
    seq.num_kept_positions = kept.first + n


def _take_layer_outputs(seq: Sequence) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
    """The hidden states and attentions ``seq`` kept since its last delta (where asked for),
    less those of positions past its last token but one: rejected drafts', and a stop string's
    cut (the last token is not fed)."""
    excess = max(0, seq.num_kept_positions - (seq.num_tokens - 1))
    seq.num_kept_positions -= excess
    states, attentions = None, None
    if seq.hidden_states:
        states = torch.cat(seq.hidden_states, dim=1)
        states = states[:, : states.shape[1] - excess]
    if seq.params.return_attentions:
        attentions = seq.attentions[: len(seq.attentions) - excess]
    seq.hidden_states, seq.attentions = [], []
    return states, attentions


def cuda_kv_blocks(device: torch.device, config: EngineConfig, block_bytes: int) -> int:
    """KV blocks that fit on ``device`` once the weights are there: the engine may hold
    ``gpu_memory_utilization`` of the device's memory (vLLM's rule), less what is already in use
    and :data:`ACTIVATION_RESERVE_BYTES` for activations. The choice is logged.

    Engines that were dropped are collected first, and torch's cache of freed blocks handed
    back, as vLLM does before it measures: else the memory a dead engine's pool held would
    count as in use, and a second engine in one process would find no room."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * config.gpu_memory_utilization) - (total - free) - ACTIVATION_RESERVE_BYTES
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"no room for a KV cache on {device}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB "
            f"free, gpu_memory_utilization={config.gpu_memory_utilization}; raise it, or free "
            "memory, or set num_kv_blocks"
        )
    logger.info(
        "KV cache on %s: %d blocks of %d tokens (%d tokens), %.2f GiB "
        "(gpu_memory_utilization=%.2f)",
        device, num_blocks, config.block_size, num_blocks * config.block_size,
        num_blocks * block_bytes / 2**30, config.gpu_memory_utilization,
    )  # fmt: skip
    return num_blocks


def bad_word_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:  # noqa: ANN401
    """Each word's token ids as ``tokenizer`` spells it alone, and after a space where that
    spelling starts with another token and has as many tokens (vLLM's bad_words rule: a word
    mid-sentence is usually the spelling with the space)."""
    found: list[list[int]] = []
    for word in words:
        alone, spaced = (
            list(tokenizer.encode(text, add_special_tokens=False))
            for text in (word.lstrip(), " " + word.lstrip())
        )
        found.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            found.append(spaced)
    return found
