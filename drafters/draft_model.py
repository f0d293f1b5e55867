"""A smaller causal LM as drafter (Leviathan et al. 2023; Chen et al. 2023), or the target's
own weights quantized (``quantized_self``: a draft that needs no training and agrees with the
target almost always, read at a quarter of the bytes; by default ``w4a8``, int4 weights and int8
activations, where the CPU has AVX-512 VNNI or AVX2, else weight-only ``int4``).

``quantized_self`` has the target's shape, so it reads the target's own KV cache instead of
keeping one (QSpec, Zhao et al. 2024, drafts with a model's own low-precision run and reuses
its KV cache likewise): it never prefills a prompt, holds no KV memory and sees its context at the
target's precision. It writes K/V only at positions the target has not computed (the last token
and the drafts it feeds), and the target writes every position before any of its queries reads
it (that is how rejected drafts are rolled back), so those writes never reach the target's
output. It drafts only for a sequence whose tokens are all in the cache but the last.

The draft model shares the target's vocabulary and its block tables: it gets KV tensors of its
own, indexed by the same block ids, so one block table per sequence serves both models. Each step
it first catches up on the tokens the target accepted since it last ran (one batched forward over
every sequence's new tokens, which also yields the first draft), then proposes the remaining
drafts one batched forward at a time.

Drafts are chosen by :func:`specdec.verifier.draft_tokens`, the target's own rule, on the draft's
logits processed as the target's are (bias, penalties, a guided request's allowed tokens):
greedy requests take the draft's argmax; sampled requests take the winner of the exponential race
over the draft distribution ``q`` (processed exactly like the target's ``p``) with the noise of
the position drafted, the very noise the target's race at that position uses. This *Gumbel-max
coupling* (Daliri, Musco and Suresh 2024, "Coupling without Communication and Drafter-Invariant
Speculative Decoding") makes the draft equal the target's token whenever the
two races have the same winner, and the verifier accepts a draft exactly then
(specdec/verifier.py), so nothing about ``q`` needs to be kept. A draft is accepted with
probability ``P(race winner of q == race winner of p)``, which lies between
``(1 - TV) / (1 + TV)`` and the ``1 - TV(p, q)`` of the optimal ``min(1, p / q)`` rule with
independently sampled drafts. We accept that small loss for what it buys: the emitted tokens are
the target's race winners, so a seeded request's output is identical to plain decoding with the
same seed, whatever the draft model, the draft depth or the batch; and ``q`` never leaves the
drafter.

Which positions of the draft cache are valid is found by comparing the tokens the draft was fed
with the sequence's tokens: after a rejection, the first mismatch marks where the cache goes
stale, and those positions are simply overwritten by the next catch-up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from specdec.drafters.base import DrafterBase, FinishedStep
from specdec.drafters.policy import PRIOR_ACCEPTANCE
from specdec.loader import LoadedCheckpoint, load_checkpoint, prequantized_weights
from specdec.models.llama import LlamaForCausalLM
from specdec.models.quant import QUANTIZATIONS, default_draft_quantization
from specdec.runner import ModelRunner, QueryChunk
from specdec.scheduler import Scheduler
from specdec.sequence import Sequence
from specdec.verifier import draft_tokens

if TYPE_CHECKING:
    from specdec.engine import Engine


@dataclass(slots=True)
class DraftModelOptions:
    draft_model: str | os.PathLike | Any | None = None  # a path or an in-memory model
    draft_tokenizer: Any = None  # tokenizer of an in-memory draft model (checked vs the target)

    def __post_init__(self) -> None:
        if self.draft_model is None:
            raise ValueError("drafter 'draft_model' needs draft_model= (a path or a model)")


@dataclass(slots=True)
class QuantizedSelfOptions:
    draft_quantization: str | None = None  # one of models/quant.py's; None: the fastest here
    # the draft runs each request's LoRA adapter too: more drafts accepted through an adapter
    # that changes the output much, at the price of the deltas in every draft step
    draft_lora: bool = False

    def __post_init__(self) -> None:
        if self.draft_quantization is not None and self.draft_quantization not in QUANTIZATIONS:
            raise ValueError(
                f"draft_quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                f"{self.draft_quantization!r}"
            )


class DraftModelDrafter(DrafterBase):
    name = "draft_model"
    Options: ClassVar[type[Any]] = DraftModelOptions

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        shares_target_kv: bool = False,
    ):
        self.shares_target_kv = shares_target_kv  # reads the target's KV cache (quantized_self)
        # The policy's acceptance before it has measured any: a copy of the target agrees almost
        # always (int4 copies of the default model: over 90% per draft position); another model
        # is not assumed to.
        self.prior_acceptance = 0.9 if shares_target_kv else PRIOR_ACCEPTANCE
        self.runner = runner
        self.draft_forward = runner.dummy_forward
        self.scheduler = scheduler
        self.fed: dict[int, list[int]] = {}  # seq_id -> tokens whose draft KV is cached, in order

    @classmethod
    def build(cls, options: Any, engine: Engine, target: Any) -> DraftModelDrafter:
        """Load the draft model, check its vocabulary, give it KV tensors on the shared blocks."""
        dtype = engine.runner.k_caches[0].dtype
        tokenizer = options.draft_tokenizer or engine.tokenizer
        checkpoint = load_checkpoint(options.draft_model, tokenizer, dtype)
        target_config = engine.runner.model.config
        _check_vocabulary(checkpoint.config, checkpoint.tokenizer, target_config, engine.tokenizer)
        # Drafts need not be batch-invariant: only the target's logits decide what is kept.
        model = LlamaForCausalLM.from_hf(
            checkpoint.config,
            checkpoint.state_dict,
            engine.max_model_len,
            batch_invariant=False,
            device=engine.device,  # the target's
        )
        return cls.on_shared_blocks(model, engine)

    @classmethod
    def on_shared_blocks(cls, model: LlamaForCausalLM, engine: Engine) -> DraftModelDrafter:
        """A drafter running ``model`` on KV tensors of its own, indexed by the engine's blocks."""
        dtype = engine.runner.k_caches[0].dtype
        block_manager = engine.scheduler.block_manager
        runner = ModelRunner(model, block_manager.num_blocks, block_manager.block_size, dtype)
        return cls(runner, engine.scheduler)

    def draft_class(self, seq: Sequence) -> int:
        return 1  # the draft model always has a guess, of one kind

    def catch_up_tokens(self, seq: Sequence) -> int:
        """Tokens the draft cache lacks before it can draft again for ``seq`` (at least its last
        one; a rejected draft it fed makes the real count a little larger). A sequence it never
        drafted for counts 1: its prompt is a one-time cost, as the target's prefill is, and
        pricing it in one step would keep a good draft model off long prompts for good."""
        if self.shares_target_kv:
            return 1  # the target's cache holds every earlier token
        return 1 if seq.seq_id not in self.fed else seq.num_tokens - self._valid_prefix(seq)

    def propose(
        self, seqs: list[Sequence], num_drafts: list[int], step: FinishedStep | None = None
    ) -> None:
        active, ks = [], []
        for seq, k in zip(seqs, num_drafts):
            seq.spec_token_ids = []
            if self.shares_target_kv and seq.num_computed_tokens != seq.num_tokens - 1:
                k = 0  # the target's cache does not hold its context yet (a prompt in chunks)
            if k:
                covered = self.scheduler.reserve_lookahead(seq, seq.num_tokens + k - 1)
                k = min(k, covered - seq.num_tokens + 1)
            if k > 0:
                active.append(seq)
                ks.append(k)
        if active:
            self._draft(active, ks)

    def _draft(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Catch up and draft ``ks[i]`` tokens for each sequence, batched across sequences."""
        chunks = [self._catch_up(seq) for seq in seqs]
        live = list(range(len(seqs)))  # sequences still drafting
        for j in range(max(ks)):
            logits = self.runner.forward([chunks[i] for i in live])[0]  # [len(live), V]
            tokens = draft_tokens(logits, [seqs[i] for i in live])
            next_live = []
            for i, token in zip(live, tokens):
                seq = seqs[i]
                seq.spec_token_ids.append(token)
                if j + 1 < ks[i]:
                    position = seq.num_tokens + j
                    if not self.shares_target_kv:
                        self.fed[seq.seq_id].append(token)
                    chunks[i] = QueryChunk([token], position, seq.block_table, 1, seq.lora_key)
                    next_live.append(i)
            live = next_live

    def _catch_up(self, seq: Sequence) -> QueryChunk:
        """The tokens the draft cache lacks: from the first stale position to the last token."""
        if self.shares_target_kv:  # only the last token: the target's cache holds the rest
            last = seq.num_tokens - 1
            return QueryChunk(seq.token_ids[-1:], last, seq.block_table, 1, seq.lora_key)
        valid = self._valid_prefix(seq)
        self.fed[seq.seq_id] = seq.token_ids[:]
        return QueryChunk(seq.token_ids[valid:], valid, seq.block_table, 1, seq.lora_key)

    def _valid_prefix(self, seq: Sequence) -> int:
        """How many leading tokens of ``seq`` the draft cache holds right (a rejected draft it
        fed is stale), short of the last token, which is always fed for its logits."""
        fed = self.fed.get(seq.seq_id, [])
        n = min(len(fed), seq.num_tokens - 1)
        stale = np.flatnonzero(np.asarray(fed[:n]) != np.asarray(seq.token_ids[:n]))
        return int(stale[0]) if stale.size else n

    def forget(self, seq: Sequence) -> None:
        self.fed.pop(seq.seq_id, None)


class QuantizedSelfDrafter(DraftModelDrafter):
    """The target's own weights, quantized, as the draft model, on the target's KV cache."""

    name = "quantized_self"
    Options = QuantizedSelfOptions

    @classmethod
    def build(cls, options: Any, engine: Engine, target: LoadedCheckpoint) -> DraftModelDrafter:
        """The target's own weights, quantized (``options.draft_quantization``, by default
        :func:`~specdec.models.quant.default_draft_quantization`), as the draft model.

        A GGUF target's Q4_1/Q8_0 weights are used as the file holds them; a float target's are
        quantized (see :mod:`specdec.models.quant`). The full-precision target verifies, so the
        output stays the target's own.
        """
        model = LlamaForCausalLM.from_hf(
            target.config,
            target.state_dict,
            engine.max_model_len,
            batch_invariant=False,
            quantization=options.draft_quantization or default_draft_quantization(),
            prequantized=prequantized_weights(target),
        )
        model.embed_tokens = engine.runner.model.embed_tokens  # the same rows: share them
        target_caches = (engine.runner.k_caches, engine.runner.v_caches)
        dtype, blocks = engine.runner.k_caches[0].dtype, engine.scheduler.block_manager
        runner = ModelRunner(model, blocks.num_blocks, blocks.block_size, dtype, target_caches)
        drafter = cls(runner, engine.scheduler, shares_target_kv=True)
        if options.draft_lora:  # the target's shapes: it can run each request's LoRA adapter
            drafter.adapter_model = model
        return drafter


def _check_vocabulary(
    draft_config: Any, draft_tokenizer: Any, target_config: Any, target_tokenizer: Any
) -> None:
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft_config.vocab_size} tokens) differs from the "
            f"target's ({target_config.vocab_size}): a draft model must share the target's "
            f"tokenizer"
        )
    if draft_tokenizer is not target_tokenizer and (
        draft_tokenizer.get_vocab() != target_tokenizer.get_vocab()
    ):
        raise ValueError("the draft model's tokenizer maps tokens differently from the target's")
