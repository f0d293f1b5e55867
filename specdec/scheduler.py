"""The scheduler: which sequences run each step, with how many query tokens.

Every step a running sequence is given ``num_tokens + len(spec_token_ids) - num_computed_tokens``
tokens of work, capped by the step's token budget. That one rule covers a fresh prompt (a prefill,
chunked when it exceeds the budget), a plain decode (one token) and draft verification (the last
token plus the drafts): there is no separate speculative phase. Running sequences are served
first, oldest first; waiting ones are admitted while the budget, ``max_num_seqs`` and KV memory
allow, except that one whose prompt shares full blocks with a running sequence's still being
prefilled waits for them, to take them from the prefix cache, and one whose LoRA adapter would be
one more than ``max_loras`` in the step waits for one to finish. When KV blocks run out, the newest
running sequence is preempted: its blocks are freed and it is recomputed later from its tokens,
which changes no output.

Under the ``"priority"`` policy (vLLM's), the waiting line is kept in order of each request's
priority (lower first), then of arrival, and the running sequence last in that order is the one
preempted; a preempted sequence takes its place in the line again. Running sequences are served
in the order they were admitted, under either policy.
"""

from __future__ import annotations

import bisect
import os
import time
from collections import deque
from dataclasses import dataclass, field

from specdec.block_manager import BlockManager
from specdec.engine_config import EngineConfig
from specdec.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: the sequences in batch order and the query tokens of each."""

    seqs: list[Sequence] = field(default_factory=list)  # running this step, batch order
    num_scheduled_tokens: list[int] = field(default_factory=list)  # query tokens per sequence
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting this step
    # (source, destination) KV blocks to copy before the forward: cached partial blocks taken by
    # sequences admitted this step (see specdec.block_manager)
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def samples(self, i: int) -> bool:
        """Whether sequence ``i`` reaches its last token this step (and so yields tokens)."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_scheduled_tokens[i] >= seq.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_priority = config.scheduling_policy == "priority"

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            self._line_up(seq)
        else:
            self.waiting.append(seq)

    def _line_up(self, seq: Sequence) -> None:
        """Put ``seq`` in the waiting line by (priority, arrival)."""
        self.waiting.insert(bisect.bisect(self.waiting, _rank(seq), key=_rank), seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0 or seq.status is not SequenceStatus.RUNNING:
                continue
            num_tokens = self._fit_running(seq, min(seq.num_uncomputed_tokens, budget), out)
            if num_tokens:
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(num_tokens)
                budget -= num_tokens
        deferred: list[Sequence] = []  # waiting for a shared prefix's prefill, or a LoRA slot
        while self.waiting and budget and len(self.running) < self.config.max_num_seqs:
            if self._shares_a_prefill(self.waiting[0]) or self._lora_slots_full(self.waiting[0]):
                deferred.append(self.waiting.popleft())
                continue
            num_tokens = self._admit(self.waiting[0], budget)
            if not num_tokens:
                break
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(num_tokens)
            budget -= num_tokens
        self.waiting.extendleft(reversed(deferred))  # they keep their places in line
        out.copies = self.block_manager.take_copies()
        return out

    def _shares_a_prefill(self, seq: Sequence) -> bool:
        """Whether ``seq`` should wait for a running sequence that is still prefilling blocks of
        the prompt they share: once that one has computed them, ``seq`` takes them from the
        prefix cache instead of computing them again (the ``n`` choices of one request, or
        prompts with a common preamble, arriving together)."""
        bs = self.block_manager.block_size
        if not self.block_manager.enable_prefix_caching or seq.block_table:
            return False
        if seq.num_prompt_tokens <= bs or seq.needs_every_position:
            return False
        head = seq.token_ids[:bs]
        for other in self.running:
            if other.num_computed_tokens >= other.num_prompt_tokens or other.token_ids[:bs] != head:
                continue
            if other.lora_key != seq.lora_key:  # other K/V for the same tokens
                continue
            shared = len(os.path.commonprefix([seq.prompt_token_ids, other.prompt_token_ids]))
            if other.num_computed_tokens < shared // bs * bs:
                return True
        return False

    def _lora_slots_full(self, seq: Sequence) -> bool:
        """Whether ``seq`` runs through a LoRA adapter that no running sequence uses while
        ``max_loras`` adapters already run (vLLM's limit on the adapters of one step)."""
        if not seq.lora_key:
            return False
        running = {other.lora_key for other in self.running if other.lora_key}
        return seq.lora_key not in running and len(running) >= self.config.max_loras

    def _fit_running(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> int:
        """Allocate KV for ``num_tokens`` more positions, shedding drafts, then preempting."""
        bm = self.block_manager
        # Drafts never reach past the context limit, nor past the end of the token budget.
        room = self.max_model_len - seq.num_tokens
        num_spec = max(0, seq.num_computed_tokens + num_tokens - seq.num_tokens)
        del seq.spec_token_ids[max(0, min(num_spec, room)) :]
        num_tokens = min(num_tokens, seq.num_uncomputed_tokens)
        while not bm.can_allocate(seq, seq.num_computed_tokens + num_tokens):
            if seq.spec_token_ids:  # lookahead slots are the first thing to give up
                num_tokens -= len(seq.spec_token_ids)
                seq.spec_token_ids.clear()
                continue
            victim = max(self.running, key=_rank) if self.by_priority else self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return 0
        bm.allocate(seq, seq.num_computed_tokens + num_tokens)
        return num_tokens

    def reserve_lookahead(self, seq: Sequence, num_positions: int) -> int:
        """Grow ``seq``'s blocks toward ``num_positions`` for a drafter's lookahead KV writes.

        Only blocks beyond one per running sequence are handed out, so that lookahead never
        forces a preemption. Returns the positions the block table now covers.
        """
        bm = self.block_manager
        spare = max(0, bm.num_free_blocks - len(self.running))
        blocks = min(bm.blocks_needed(seq, num_positions), spare)
        bm.allocate(seq, (len(seq.block_table) + blocks) * bm.block_size)
        return len(seq.block_table) * bm.block_size

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Tokens a waiting sequence can run now (0: not yet), after prefix-cache hits."""
        bm = self.block_manager
        if not seq.block_table and not seq.needs_every_position:
            bm.match_prefix(seq)
        num_tokens = min(seq.num_uncomputed_tokens, budget)
        if not bm.can_allocate(seq, seq.num_computed_tokens + num_tokens):
            bm.free(seq)  # give back any prefix hits; retry when memory frees up
            return 0
        bm.allocate(seq, seq.num_computed_tokens + num_tokens)
        return num_tokens

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free a running sequence's KV and requeue it for recompute: first in line, or in its
        place by priority."""
        self.block_manager.free(seq)
        seq.spec_token_ids.clear()
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.running.remove(seq)
        if seq in out.seqs:
            i = out.seqs.index(seq)
            del out.seqs[i], out.num_scheduled_tokens[i]
        out.preempted.append(seq)
        if self.by_priority:
            self._line_up(seq)
        else:
            self.waiting.appendleft(seq)

    def update(self, out: SchedulerOutput, emitted: list[list[int]]) -> list[Sequence]:
        """Record a step: advance counters, roll back rejected drafts, append emitted tokens.

        ``emitted[i]`` holds the tokens sequence ``i`` produced this step: its accepted drafts and
        then one recovered or bonus token (empty for a prefill chunk that did not reach the end).
        Returns the sequences that received tokens, in batch order.
        """
        updated = []
        now = time.perf_counter()
        for seq, num_scheduled, tokens in zip(out.seqs, out.num_scheduled_tokens, emitted):
            seq.num_computed_tokens += num_scheduled
            if tokens:
                num_spec = len(seq.spec_token_ids)
                num_accepted = len(tokens) - 1
                seq.num_computed_tokens -= num_spec - num_accepted  # rollback is arithmetic
                seq.spec_token_ids.clear()
                self.block_manager.register_full_blocks(seq)  # before a finish frees them
                self._append(seq, tokens, now)
                updated.append(seq)
            if not seq.is_finished:
                self.block_manager.register_full_blocks(seq)
        return updated

    def _append(self, seq: Sequence, tokens: list[int], now: float) -> None:
        """Append tokens one by one, stopping exactly where plain decoding would stop."""
        seq.metrics.num_steps += 1
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        params = seq.params
        for token in tokens:
            seq.token_ids.append(token)
            if token in params.stop_token_ids or (
                token in seq.eos_token_ids and not params.ignore_eos
            ):
                self.finish(seq, "stop")
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                self.finish(seq, "length")
            if seq.is_finished:
                return

    def finish(self, seq: Sequence, reason: str, num_output_tokens: int | None = None) -> None:
        """End a sequence (keeping at most ``num_output_tokens`` outputs) and free its KV."""
        if num_output_tokens is not None:
            del seq.token_ids[seq.num_prompt_tokens + num_output_tokens :]
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finish_time = time.perf_counter()
        self.block_manager.free(seq)
        seq.spec_token_ids.clear()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)


def _rank(seq: Sequence) -> tuple[int, int]:
    """A sequence's place under the priority policy: its priority, then its arrival (ids are
    given in arrival order)."""
    return seq.priority, seq.seq_id
