"""The engine: requests in, a step loop, tokens out.

``Engine.step`` is the whole decoding loop (see the README's Architecture section): schedule,
one forward, verify, update. Everything a request owns lives on its :class:`Sequence`; the KV
memory is the runner's; the block ids are the scheduler's block manager's.
"""

from __future__ import annotations

import itertools

import torch

from specdec.config import EngineConfig, SamplingParams
from specdec.detokenizer import Detokenizer
from specdec.models.llama import LlamaForCausalLM
from specdec.outputs import RequestOutput
from specdec.runner import ModelRunner, kv_block_bytes
from specdec.scheduler import Scheduler
from specdec.sequence import Sequence
from specdec.verifier import Verifier


class Engine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer,
        config: EngineConfig,  # noqa: ANN001
        dtype: torch.dtype,
        max_model_len: int,
    ):
        self.config = config
        self.tokenizer = tokenizer
        num_blocks = config.num_kv_blocks or max(
            1,
            int(config.kv_cache_memory_gb * 2**30)
            // kv_block_bytes(model, config.block_size, dtype),
        )
        # A lone sequence must always fit, so that preemption can always make progress.
        self.max_model_len = min(max_model_len, num_blocks * config.block_size)
        self.vocab_size = model.config.vocab_size
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len)
        self.runner = ModelRunner(model, num_blocks, config.block_size, dtype)
        self.verifier = Verifier()
        self.detokenizer = Detokenizer(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id
        self.requests: dict[int, Sequence] = {}
        self._ids = itertools.count()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Queue a request; bad prompts raise ``ValueError`` before anything is allocated."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: give at least one token")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens, but the context holds at most "
                f"{self.max_model_len} (prompt + output): shorten the prompt"
            )
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        seq = Sequence(next(self._ids), list(prompt_token_ids), n, params, self.eos_token_id)
        self.requests[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, request_id: int) -> None:
        """Stop a request now and free its KV blocks (unknown or finished ids are ignored)."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")

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
        res = self.runner.run(out)
        emitted = self.verifier.verify(out, res)
        updated = self.scheduler.update(out, emitted)
        return [self._delta(seq) for seq in updated]

    def _delta(self, seq: Sequence) -> RequestOutput:
        """The text and tokens ``seq`` gained since its previous delta."""
        text = self.detokenizer.step(seq, self.scheduler)
        new_tokens = seq.output_token_ids[seq.num_returned_tokens :]
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
        )
