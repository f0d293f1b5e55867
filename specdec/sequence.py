"""Request state: one :class:`Sequence` per request, made of ints and lists.

Terms (vLLM's):
    tokens: prompt tokens followed by the output tokens generated so far.
    num_computed_tokens: how many leading tokens have their KV written in the cache. A running
        sequence normally has every token but the last one computed; the last is fed next step.
    spec_token_ids: draft tokens proposed for the next step. They are scheduled as extra query
        tokens after the last token; rejected ones are rolled back by lowering
        ``num_computed_tokens`` (their KV slots are simply overwritten later).
    block_table: the KV block ids holding this sequence's tokens, in order.
    seed: the request's noise seed: ``SamplingParams.seed``, or one drawn from torch's global RNG
        (the engine's own generator, with ``EngineConfig.seed``) when the sequence is created (so
        ``torch.manual_seed`` makes unseeded runs reproducible and unseeded requests stay
        independent). Each sampled token's noise is keyed by the seed and
        the token's position (:func:`specdec.sampling.exponential_noise`); greedy rows ignore it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdec.config import SamplingParams

if TYPE_CHECKING:
    from specdec.outputs import TokenLogprobs
    from specdec.pooling import Pooler
    from specdec.structured.guide import Guide


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SequenceMetrics:
    """Timings and counters of one request; speculative counters stay 0 without a drafter."""

    arrival_time: float = 0.0  # time.perf_counter() when the request was added
    first_token_time: float | None = None  # when the first output token was produced
    finish_time: float | None = None  # when the request finished
    num_steps: int = 0  # engine steps that produced output tokens for this request
    num_preemptions: int = 0  # times its KV was freed to make room and recomputed
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # draft tokens accepted

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class Sequence:
    """One request: its tokens, KV bookkeeping and sampling state."""

    seq_id: int  # engine-unique id
    token_ids: list[int]  # prompt + output tokens
    num_prompt_tokens: int  # length of the prompt prefix of token_ids
    params: SamplingParams  # how to sample this request
    eos_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence ids (any of them ends it)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)  # KV block ids, in position order
    block_hashes: list[int] = field(default_factory=list)  # hash chain of registered full blocks
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    finish_reason: str | None = None  # "stop" or "length" once finished
    num_returned_tokens: int = 0  # output tokens already handed back in deltas
    output_text: str = ""  # detokenized output so far (stop strings already cut off)
    # with SamplingParams.stop_strings: the text of the prompt's last tokens, where one may begin
    stop_context: str | None = None
    # incremental detokenization (vLLM's): the output's text through output token read_offset,
    # whose tokens from prefix_offset on are decoded again next step as context
    decoded_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    metrics: SequenceMetrics = field(default_factory=SequenceMetrics)
    # with SamplingParams.prompt_logprobs: entry i is prompt token i + 1's, as far as computed
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with SamplingParams.return_hidden_states: [layers + 1, n, hidden] states of the positions
    # computed since the last delta, in order; with return_attentions, per such position p its
    # [layers, heads, p + 1] probabilities; and how many positions have been kept in all
    hidden_states: list[torch.Tensor] = field(default_factory=list)
    attentions: list[torch.Tensor] = field(default_factory=list)
    num_kept_positions: int = 0
    # with SamplingParams.choice, regex, json_schema or grammar: which tokens may come next (see
    # specdec/structured/guide.py), and its state after each output token walked so far
    guide: Guide | None = None
    guide_states: list[Any] = field(default_factory=list)
    # with SamplingParams.bad_words: each word's token ids, in each spelling (Engine.add_request)
    bad_word_ids: list[list[int]] = field(default_factory=list)
    # with SamplingParams.allowed_token_ids: those ids as a tensor, made once (a row indexed by a
    # long Python list converts the list each time)
    allowed_ids: torch.Tensor | None = field(default=None, init=False)
    priority: int = 0  # with the "priority" scheduling policy: lower runs first
    lora_key: int = 0  # the LoRA adapter its tokens run through (specdec.lora); 0: none
    # an embedding request's pooler (LLM.embed, /v1/embeddings): its prompt's final states pooled
    pooler: Pooler | None = None
    seed: int = field(init=False)  # noise seed: params.seed, else drawn at creation
    seeds: InitVar[torch.Generator | None] = None  # where an unseeded seed is drawn; None: global

    def __post_init__(self, seeds: torch.Generator | None) -> None:
        if self.params.seed is not None:
            self.seed = self.params.seed
        else:
            self.seed = int(torch.randint(2**63 - 1, (), generator=seeds))
        if self.params.allowed_token_ids is not None:
            self.allowed_ids = torch.tensor(self.params.allowed_token_ids, dtype=torch.long)
        if not self.metrics.arrival_time:
            self.metrics.arrival_time = time.perf_counter()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (a prefix-cache hit would skip
        the positions they come from)."""
        wanted = self.params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def needs_layer_outputs(self) -> bool:
        """Hidden states or attentions asked for, and some position fed so far not yet kept."""
        return self.params.keeps_layers and self.num_kept_positions < self.num_tokens - 1

    @property
    def needs_every_position(self) -> bool:
        """Whether each position must be computed, none taken from the prefix cache."""
        pools = (
            self.pooler is not None and self.pooler.reads_every_position and not self.pooler.done
        )
        return self.needs_prompt_logprobs or self.needs_layer_outputs or pools

    def allowed_tokens(self, drafts: int) -> list[int] | torch.Tensor | None:
        """With a guide: the tokens that may follow the output and the first ``drafts`` drafts
        (ids, or a [V] bool mask; end-of-sequence ids where the output is whole); None where any
        may, or where the drafts already left the guide's language (a row that is never used)."""
        if self.guide is None:
            return None
        state = self._output_state()
        for token in self.spec_token_ids[:drafts]:
            if state is None:
                break
            state = self.guide.advance(state, token)
        return None if state is None else self.guide.allowed(state)

    def guided_drafts(self) -> int:
        """How many leading drafts the guide allows (one walk along them): a draft it forbids
        would be rejected, and so would every draft after it."""
        assert self.guide is not None
        state = self._output_state()
        for j, token in enumerate(self.spec_token_ids):
            allowed = None if state is None else self.guide.allowed(state)
            if allowed is None or not (
                bool(allowed[token]) if isinstance(allowed, torch.Tensor) else token in allowed
            ):
                return j
            state = self.guide.advance(state, token)
        return len(self.spec_token_ids)

    def _output_state(self) -> Any:
        """The guide's state after the output (None: it left the guide's language), the
        states along the output kept, so that each step walks only what is new."""
        assert self.guide is not None
        states = self.guide_states or [self.guide.start()]
        self.guide_states = states
        while len(states) <= self.num_output_tokens:
            state = states[-1]
            token = self.token_ids[self.num_prompt_tokens + len(states) - 1]
            states.append(None if state is None else self.guide.advance(state, token))
        return states[self.num_output_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Query tokens still to run: the uncomputed tail plus the drafts to verify."""
        return self.num_tokens + len(self.spec_token_ids) - self.num_computed_tokens
