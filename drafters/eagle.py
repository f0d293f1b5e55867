"""EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"): a one-layer head that drafts at the level of the target's features.

Terms: the *feature* ``f[p]`` is the target's final hidden state at position ``p`` (after the
final norm: what its output layer reads to predict ``x[p + 1]``). The head's *row* ``p`` takes
the token ``x[p]`` and the feature before it, ``f[p - 1]`` (zeros where there is none: at
position 0, and where the target's feature was never seen, see below), fuses them,
``fc([embed(x[p]); f[p - 1]])``, and runs one decoder layer of the target's shape over them,
attending to its own keys and values of rows ``0 .. p``, then a norm: the result is its guess of
``f[p]``, and the target's output rows over the reduced vocabulary (drafters/heads.py) turn it
into a guess of ``x[p + 1]``.

Each step, after verification, the head queues, for every scheduled sequence, the rows of the
positions the target computed and kept this step (prompt chunks included), with their real
features. Before it drafts for a sequence it *catches up*: it runs that sequence's queued rows,
all drafting sequences in one forward. Its last row is at the sequence's newest token, so its
output is the first draft. A sequence the policy gives no drafts (a busy engine, a sequence
whose drafts keep failing) costs the head nothing until it drafts again: the queue is its
``catch_up_tokens``, which the policy prices as it prices a draft model's (drafters/policy.py).
Drafting goes on autoregressively, ``k - 1`` more rows of one token each, fed the head's own
output feature in place of the target's. Draft rows lie past the target's computed positions, so
the next catch-up overwrites them: rollback is, as for the target, nothing but bookkeeping.

The head's K/V tensors are its own, indexed by the engine's block ids, so one block table per
sequence serves both (as for a draft model, drafters/draft_model.py). A sequence the head has
no row for at the start of a step's positions (its first chunk, a prompt whose prefix came from
the prefix cache, a recompute after preemption) gets that row with a zero feature: the head then
sees one position without its feature, which lowers acceptance a little and never changes
output (verification decides that).

Drafts follow the target's own rule with the noise of the position drafted, as the other
drafters' do (greedy: argmax; sampled: the exponential race).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.attention import AttentionMetadata
from specdec.drafters.base import DrafterBase, FinishedStep
from specdec.drafters.heads import DraftVocabHead, HeadsOptions, load_for_target
from specdec.models.llama import DecoderLayer, ModelArchConfig, RMSNorm, Rope
from specdec.runner import HostStaging
from specdec.sequence import Sequence

if TYPE_CHECKING:
    from specdec.engine import Engine
    from specdec.models.llama import LlamaForCausalLM


class EagleHead(nn.Module):
    """``fc([embedding; feature])``, one decoder layer of the target's shape, a norm."""

    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,  # [N, H] token embeddings x[p]
        features: torch.Tensor,  # [N, H] the features f[p - 1]
        rope: Rope,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [N, H] the guesses of f[p]
        """The paged path the drafter runs (the layer's ``k_cache``/``v_cache`` set)."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        out, residual = self.layer.forward(x, None, rope, meta)
        return self.norm.forward(out, residual)

    def forward_train(
        self,
        embeds: torch.Tensor,  # [B, T, H]
        features: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
    ) -> torch.Tensor:  # [B, T, H]
        """The same function on whole sequences (causal), in differentiable torch ops, for
        training; tests check that it equals the paged path."""
        cfg, layer = self.cfg, self.layer
        attn, mlp = layer.self_attn, layer.mlp
        b, t, _ = embeds.shape
        x = self.fc(torch.cat([embeds, features], dim=-1))  # [B, T, H], the residual stream
        h = _rms(x, layer.input_layernorm)
        qkv = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = _rotate(q.view(b, t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = _rotate(k.view(b, t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim)
        out = F.scaled_dot_product_attention(  # [B, Hq, T, D], each query head on its group
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=attn.scale,
            enable_gqa=True,
        )
        x = x + F.linear(out.transpose(1, 2).reshape(b, t, attn.q_size), attn.o_proj.weight)
        gate, up = F.linear(_rms(x, layer.post_attention_layernorm), mlp.gate_up_proj.weight).chunk(
            2, dim=-1
        )
        x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight)
        return _rms(x, self.norm)


def _rms(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    # the weight in the input's dtype: under bf16 autocast, the fused kernel needs them equal
    return F.rms_norm(x, norm.weight.shape, norm.weight.to(x.dtype), norm.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``[B, T, heads, D]`` with ``[T, D]`` tables, as transformers' rotate_half."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class EagleDrafter(DrafterBase):
    name = "eagle"
    Options = HeadsOptions
    prior_acceptance = 0.6
    needs_token_hidden_states = True

    def __init__(
        self, head: EagleHead, vocab: DraftVocabHead, target: LlamaForCausalLM, engine: Engine
    ):
        self.head, self.vocab = head, vocab
        self.embed, self.rope = target.embed_tokens, target.rope  # the target's own: shared
        self.scheduler = engine.scheduler
        bm = engine.scheduler.block_manager
        self.block_size = bm.block_size
        cfg, weight = head.cfg, target.embed_tokens.weight
        shape = (bm.num_blocks, bm.block_size, cfg.num_kv_heads, cfg.head_dim)
        attn = head.layer.self_attn
        attn.k_cache, attn.v_cache = (
            torch.zeros(shape, dtype=weight.dtype, device=weight.device),
            torch.zeros(shape, dtype=weight.dtype, device=weight.device),
        )
        # the target's attention path: the Triton kernel on CUDA, with its metadata staged
        self.triton_attention = engine.runner.triton_attention
        self.staging = HostStaging(weight.device) if weight.device.type != "cpu" else None
        self.written: dict[int, int] = {}  # seq_id -> position of the last row with real inputs
        self.last_feature: dict[int, torch.Tensor] = {}  # seq_id -> [H] that row's output
        # seq_id -> (first row, the features before rows first, first + 1, ...): queued rows
        self.queued: dict[int, tuple[int, list[torch.Tensor]]] = {}
        self.draft_forward = self._timing_forward

    @classmethod
    def build(cls, options: Any, engine: Engine, target: Any) -> EagleDrafter:
        model = engine.runner.model
        head, vocab = load_for_target(options, "eagle", model, lambda c: EagleHead(model.config))
        assert isinstance(head, EagleHead)
        return cls(head, vocab, model, engine)

    def forget(self, seq: Sequence) -> None:
        self.written.pop(seq.seq_id, None)
        self.last_feature.pop(seq.seq_id, None)
        self.queued.pop(seq.seq_id, None)

    def catch_up_tokens(self, seq: Sequence) -> int:
        """The rows the head must run for ``seq`` before it drafts: every position since its last
        row; 1 for a sequence it has never run (its prompt is a one-time cost, as for a draft
        model: priced in one step, it would keep the head off long prompts for good)."""
        if seq.seq_id not in self.written:
            return 1
        return max(1, seq.num_tokens - 1 - self.written[seq.seq_id])

    def propose(
        self, seqs: list[Sequence], num_drafts: list[int], step: FinishedStep | None = None
    ) -> None:
        if step is not None:
            self._queue(step)
        self._catch_up([seq for seq, k in zip(seqs, num_drafts) if k])
        drafting, ks = [], []
        for seq, k in zip(seqs, num_drafts):
            seq.spec_token_ids = []
            if not k or self.written.get(seq.seq_id) != seq.num_tokens - 1:
                continue
            covered = self.scheduler.reserve_lookahead(seq, seq.num_tokens + k - 1)
            k = min(k, covered - seq.num_tokens + 1)
            if k > 0:
                drafting.append(seq)
                ks.append(k)
        if drafting:
            self._draft(drafting, ks)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The head's K/V of cached partial blocks, copied as the target's are (its rows at
        positions the target computed: a prefix-cache hit takes them with the blocks)."""
        attn = self.head.layer.self_attn
        sources = torch.tensor([c[0] for c in copies], device=attn.k_cache.device)
        targets = torch.tensor([c[1] for c in copies], device=attn.k_cache.device)
        for cache in (attn.k_cache, attn.v_cache):
            cache[targets] = cache[sources]

    def _queue(self, step: FinishedStep) -> None:
        """Queue the head's rows for every position the target computed and kept this step."""
        hidden = step.result.token_hidden_states
        assert hidden is not None, "the runner must keep token hidden states for EAGLE"
        offset = 0
        for i, (seq, n) in enumerate(zip(step.scheduled.seqs, step.scheduled.num_scheduled_tokens)):
            start, rows = step.result.query_starts[i], hidden[offset : offset + n]
            offset += n
            kept = seq.num_computed_tokens - start  # positions start .. start + kept - 1
            if seq.is_finished or kept <= 0:
                continue
            features = rows[:kept].clone()  # f[start] .. f[start + kept - 1], for rows start + 1 ..
            first, queue = self.queued.get(seq.seq_id, (0, []))
            end = first + sum(len(f) for f in queue) - 1 if queue else self.written.get(seq.seq_id)
            if end == start:  # the rows continue the head's (queued or run)
                first, queue = (first, queue) if queue else (start + 1, [])
                self.queued[seq.seq_id] = (first, [*queue, features])
            else:  # no row at `start` yet: one with a zero feature (see the module docstring)
                zero = features.new_zeros(1, features.shape[1])
                self.queued[seq.seq_id] = (start, [zero, features])

    @torch.inference_mode()
    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Run the queued rows of ``seqs``, in one forward."""
        chunks: list[tuple[Sequence, int, torch.Tensor]] = []  # (seq, first row, features)
        for seq in seqs:
            first, queue = self.queued.pop(seq.seq_id, (0, []))
            if not queue:
                continue
            features = torch.cat(queue) if len(queue) > 1 else queue[0]
            last = first + len(features) - 1  # the newest token's row
            covered = self.scheduler.reserve_lookahead(seq, last + 1)  # rows with a KV slot
            if covered <= last:  # none for the newest token's row yet: it waits for a later step
                self.queued[seq.seq_id] = (covered, [features[covered - first :]])
                features = features[: covered - first]
                if not len(features):
                    continue
            chunks.append((seq, first, features))
        if not chunks:
            return
        tokens = [seq.token_ids[first : first + len(f)] for seq, first, f in chunks]
        output = self._forward(
            [(seq, first, t) for (seq, first, _), t in zip(chunks, tokens)],
            torch.cat([f for _, _, f in chunks]),
        )
        end = 0
        for seq, first, features in chunks:
            end += len(features)
            self.written[seq.seq_id] = first + len(features) - 1
            self.last_feature[seq.seq_id] = output[end - 1]

    @torch.inference_mode()
    def _draft(self, seqs: list[Sequence], ks: list[int]) -> None:
        """``ks[i]`` drafts for each sequence, one batched row per draft depth."""
        features = torch.stack([self.last_feature[seq.seq_id] for seq in seqs])  # [A, H]
        live = list(range(len(seqs)))
        for j in range(max(ks)):
            chosen = [seqs[i] for i in live]
            tokens = self.vocab.draft(features, chosen)
            for seq, token in zip(chosen, tokens):
                seq.spec_token_ids.append(token)
            keep = [a for a, i in enumerate(live) if j + 1 < ks[i]]
            if not keep:
                return
            live = [live[a] for a in keep]
            rows = [(seqs[i], seqs[i].num_tokens + j, [tokens[a]]) for a, i in zip(keep, live)]
            features = self._forward(rows, features[keep])

    def _forward(
        self,
        rows: list[tuple[Sequence, int, list[int]]],  # (seq, first position, tokens there)
        features: torch.Tensor,  # [N, H] the feature before each token
    ) -> torch.Tensor:  # [N, H] the head's output feature at each row
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq, first, tokens in rows:
            input_ids += tokens
            span = range(first, first + len(tokens))
            positions += span
            slots += [seq.block_table[p // bs] * bs + p % bs for p in span]
        return self._run(
            [input_ids, positions, slots],
            [len(t) for _, _, t in rows],
            [first + len(t) for _, first, t in rows],
            [seq.block_table for seq, _, _ in rows],
            features,
        )

    def _run(
        self,
        step_ids: list[list[int]],  # [3][N] token ids, positions, KV slots
        query_lens: list[int],  # [B]
        context_lens: list[int],  # [B]
        block_tables: list[list[int]],  # [B][num_blocks]
        features: torch.Tensor,  # [N, H]
    ) -> torch.Tensor:  # [N, H]
        """The head on one flat batch, its small tensors moved to the device in one copy."""
        step = torch.tensor(step_ids, dtype=torch.long)  # [3, N]
        meta = AttentionMetadata.build(
            query_lens,
            context_lens,
            block_tables,
            step[2],
            self.block_size,
            False,
            self.triton_attention,
        )
        if self.staging is not None:
            step, *tensors = self.staging.to_device([step, *meta.tensors()])
            meta.replace_tensors(tensors)
        rope = self.rope(step[1], features.dtype)
        return self.head(self.embed(step[0]), features, rope, meta)

    @torch.inference_mode()
    def _timing_forward(self, n: int) -> None:
        """A draft depth over ``n`` sequences, as the policy prices it: ``n`` rows (written to
        the first blocks of the head's cache, harmless before serving), then the output rows."""
        cache = self.head.layer.self_attn.k_cache
        n = min(n, cache.shape[0] * self.block_size)
        blocks = list(range(-(-n // self.block_size)))
        features = cache.new_zeros(n, self.head.cfg.hidden_size)
        out = self._run([[0] * n, list(range(n)), list(range(n))], [n], [n], [blocks], features)
        self.vocab.logits(out)
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)  # timed by the caller: wait for the GPU
