"""``specdec train-heads``: Medusa or EAGLE heads for a target, by self-distillation.

1. *Corpus* (:mod:`specdec.drafters.corpus`). Our own engine answers the training prompts (a
   JSONL file read through ``datasets``; by default ``eval/prompts/train_heads.jsonl``, kept
   apart from every evaluation set) with continuous batching, so the heads learn the target's
   own outputs, until ``max_train_tokens``; the prompts left over join the corpus unanswered
   (their prefill is cheap, and the target's prediction at each of their positions is a label
   like any other). With ``self_prompts`` the target first writes that many prompts of its own
   (Magpie), to train on more distinct text than a hand-written file holds. The token ids are
   saved in the output directory and reused on resume.
2. *Features and labels.* The target's final hidden state at every position of every sequence,
   from the engine's own forward (the features the drafter will see at run time), and the
   target's greedy next token there: the label every head learns, on prompt positions as on
   responses (on a greedy response it is the response's next token).
3. *Training* (through ``accelerate``: the CPU here, a GPU where there is one) with the target
   frozen. Medusa head ``i`` learns ``x[t + 1 + i]`` from ``f[t]`` (cross-entropy, weighted
   ``0.8 ** i`` as in Medusa). EAGLE learns ``f[p]`` from ``(x[p], f[p - 1])``: a smooth-L1
   regression on the feature plus 0.1 x the cross-entropy of the token it implies (EAGLE's
   loss), and, fed its own output features in place of the target's (a second, unrolled pass:
   the *training-time test* of EAGLE-3, Li et al. 2025, in its simplest form), the same loss
   again, since every draft after the first is made from its own features.

``init_from`` starts from heads trained before (a fine-tune on another corpus, for instance
the target's sampled answers), checked against the target as a drafter's heads are.

Checkpoints (heads and optimizer state as safetensors, the step in ``state.json``) are written
every ``--save-every`` steps under ``OUT/checkpoints``; a rerun resumes from the latest. The
finished heads go to ``OUT`` (drafters/heads.py's format). A loss and accuracy log is
``OUT/train_log.jsonl``; accuracy is top-1 on held-out sequences, per draft position.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafters.checkpoints import resume, save_checkpoint
from specdec.drafters.corpus import DEFAULT_DATA, load_or_generate_corpus
from specdec.drafters.eagle import EagleHead
from specdec.drafters.heads import (
    HeadsConfig,
    draft_vocabulary,
    output_rows,
    save_heads,
    start_from_heads,
)
from specdec.drafters.medusa import MedusaHeads
from specdec.runner import QueryChunk

KINDS = ("medusa", "eagle")


@dataclass(slots=True)
class TrainConfig:
    """What ``specdec train-heads`` does; every field is a command-line option."""

    kind: str  # "medusa" or "eagle"
    out: str | os.PathLike  # directory for the heads, checkpoints, corpus and log
    model: str | os.PathLike | None = None  # the target (None: the embedded default)
    dtype: str = "float32"  # the target's dtype while it writes the corpus and its features
    data: str | os.PathLike = DEFAULT_DATA  # training prompts, JSONL ("prompt" or "messages")
    self_prompts: int = 0  # prompts the target writes itself (Magpie), added to data's
    max_train_tokens: int = 200_000  # answered part of the corpus, prompt + response tokens
    unanswered: bool = True  # the prompts left over join the corpus without a response
    max_new_tokens: int = 128  # response length per prompt
    max_steps: int = 1500  # optimizer steps
    batch_tokens: int = 4096  # tokens per optimizer step (padded)
    lr: float = 1e-3
    draft_vocab_size: int = 8192
    num_heads: int = 4  # medusa's heads
    temperature: float = 0.0  # of the corpus' responses (0: the target's greedy answers)
    init_from: str | os.PathLike | None = None  # heads to start from, unless a checkpoint resumes
    save_every: int = 250
    held_out: int = 16  # sequences kept out of training, for the accuracy log
    seed: int = 0
    # "bf16": the heads' matmuls under bfloat16 autocast (weights and optimizer stay float32);
    # "auto": bf16 where the hardware multiplies bf16 natively (CUDA, or AMX / AVX512-BF16)
    mixed_precision: str = "auto"  # "auto", "bf16" or "no"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("max_train_tokens", "max_new_tokens", "max_steps", "batch_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.self_prompts < 0:
            raise ValueError(f"self_prompts must be 0 or more, got {self.self_prompts}")
        if not Path(self.data).is_file():
            raise ValueError(f"no training prompts at {self.data}")
        if self.mixed_precision not in ("auto", "bf16", "no"):
            raise ValueError(
                f"mixed_precision must be 'auto', 'bf16' or 'no', got {self.mixed_precision!r}"
            )

    def precision(self) -> str:
        """What ``mixed_precision`` means on this machine: "bf16" or "no"."""
        if self.mixed_precision != "auto":
            return self.mixed_precision
        if torch.cuda.is_available():
            return "bf16" if torch.cuda.is_bf16_supported() else "no"
        native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
        return "bf16" if native else "no"


def target_features(
    llm: Any, corpus: list[list[int]], batch_tokens: int = 2048
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The target's final hidden state at every position of each sequence (``[T, H]`` each)
    and its greedy next token there (``[T]``), from the engine's own forward (on blocks of its
    KV pool: no request may be running)."""
    runner = llm.engine.runner
    bs = runner.block_size
    features: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    num_blocks = runner.k_caches[0].shape[0]
    batch: list[list[int]] = []

    def flush() -> None:
        chunks, next_block = [], 0
        for seq in batch:
            blocks = list(range(next_block, next_block + -(-len(seq) // bs)))
            next_block += len(blocks)
            chunks.append(QueryChunk(seq, 0, blocks, 0))
        hidden = runner.forward(chunks)[2]
        with torch.inference_mode():  # [N, V] logits 512 rows at a time
            greedy = torch.cat(
                [runner.model.compute_logits(h).argmax(-1) for h in hidden.split(512)]
            )
        sizes = [len(s) for s in batch]
        features.extend(f.float().clone() for f in hidden.split(sizes))
        labels.extend(g.clone() for g in greedy.split(sizes))
        batch.clear()

    for seq in corpus:
        blocks_needed = sum(-(-len(s) // bs) for s in [*batch, seq])
        if batch and (sum(map(len, batch)) + len(seq) > batch_tokens or blocks_needed > num_blocks):
            flush()
        batch.append(seq)
    if batch:
        flush()
    return features, labels


class HeadsTrainer:
    """The heads being trained, their loss, and the frozen pieces of the target they use."""

    def __init__(self, cfg: TrainConfig, target: Any, draft_vocab: torch.Tensor):
        self.cfg, self.target = cfg, target
        self.draft_vocab = draft_vocab  # [Vd] target ids
        lm_head = output_rows(target).float()
        self.vocab_rows = lm_head[draft_vocab].contiguous()  # [Vd, H], frozen
        self.to_draft = torch.full((lm_head.shape[0],), -100, dtype=torch.long)
        self.to_draft[draft_vocab] = torch.arange(len(draft_vocab))
        self.embed = target.embed_tokens.weight.detach().float()  # [V, H], frozen
        cos, sin = target.rope.cos.float(), target.rope.sin.float()
        self.cos, self.sin = cos, sin  # [P, D]
        self.module: nn.Module
        if cfg.kind == "medusa":
            self.module = MedusaHeads(target.config.hidden_size, cfg.num_heads)
        else:
            head = EagleHead(target.config)
            head.float()
            for p in head.parameters():
                nn.init.normal_(p, std=0.02)
            for norm in (
                head.layer.input_layernorm,
                head.layer.post_attention_layernorm,
                head.norm,
            ):
                nn.init.ones_(norm.weight)
            self.module = head

    @property
    def num_positions(self) -> int:
        """Draft positions the accuracy log reports: one per head, or two EAGLE passes."""
        return self.cfg.num_heads if self.cfg.kind == "medusa" else 2

    def losses(
        self, ids: torch.Tensor, feats: torch.Tensor, greedy: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The loss of a padded batch (``ids``, the target's greedy next tokens ``greedy`` and
        ``mask`` [B, T], ``feats`` [B, T, H]) and per draft position (correct, counted) top-1
        guesses of the target's next token."""
        labels = self.to_draft[greedy].masked_fill(~mask, -100)  # [B, T] draft index
        if self.cfg.kind == "medusa":
            return self._medusa(feats, labels)
        return self._eagle(ids, feats, mask, labels)

    def _medusa(self, feats: torch.Tensor, labels: torch.Tensor):  # noqa: ANN202
        total, hits = feats.new_zeros(()), []
        outputs = self.module(feats)  # [K, B, T, H]
        for i, out in enumerate(outputs, start=1):  # head i guesses x[t + 1 + i] from f[t]
            logits = out[:, :-i] @ self.vocab_rows.T  # [B, T - i, Vd]
            target = labels[:, i:]  # the target's guess of x[t + 1 + i], made at t + i
            total = total + 0.8**i * _cross_entropy(logits, target)
            hits.append(_hits(logits, target))
        return total, hits

    def _eagle(self, ids, feats, mask, labels):  # noqa: ANN001, ANN202
        b, t, h = feats.shape
        embeds = self.embed[ids]  # [B, T, H]
        cos, sin = self.cos[:t], self.sin[:t]
        zero = feats.new_zeros(b, 1, h)
        total, hits = feats.new_zeros(()), []
        inputs = torch.cat([zero, feats[:, :-1]], dim=1)  # f[p - 1] beside x[p]
        head = self.module
        assert isinstance(head, EagleHead)
        for _ in range(2):  # the real features, then the head's own (its later drafts' case)
            out = head.forward_train(embeds, inputs, cos, sin)  # guesses of f[p]
            logits = out @ self.vocab_rows.T  # [B, T, Vd]: guesses of x[p + 1]
            target = labels
            weight = mask.float()  # [B, T]; the regression is a mean over the hidden size
            regression = F.smooth_l1_loss(out, feats, reduction="none").mean(-1)
            regression = (regression * weight).sum() / weight.sum().clamp(min=1)
            total = total + regression + 0.1 * _cross_entropy(logits, target)
            hits.append(_hits(logits, target))
            inputs = torch.cat([zero, out[:, :-1]], dim=1)
        return total, hits


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def _hits(logits: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    valid = target != -100
    return int(((logits.argmax(-1) == target) & valid).sum()), int(valid.sum())


def _batches(lengths: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Sequence indices in batches of at most ``batch_tokens`` padded tokens, similar lengths
    together, batches in random order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[i] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    rng.shuffle(batches)
    return batches


def _pad(  # noqa: ANN202
    corpus: list[list[int]],
    features: list[torch.Tensor],
    greedy: list[torch.Tensor],
    batch: list[int],
):
    longest = max(len(corpus[i]) for i in batch)
    hidden = features[batch[0]].shape[1]
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    labels = torch.zeros(len(batch), longest, dtype=torch.long)
    feats = torch.zeros(len(batch), longest, hidden)
    mask = torch.zeros(len(batch), longest, dtype=torch.bool)
    for row, i in enumerate(batch):
        n = len(corpus[i])
        ids[row, :n], labels[row, :n] = torch.tensor(corpus[i]), greedy[i]
        feats[row, :n], mask[row, :n] = features[i], True
    return ids, feats, labels, mask


def train(cfg: TrainConfig, llm: Any = None) -> Path:
    """Train heads as ``cfg`` says (resuming from ``cfg.out``'s latest checkpoint); return the
    heads directory. ``llm``: the target, already loaded (default: ``LLM(cfg.model)``)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from tqdm import tqdm

    from specdec.llm import LLM

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    llm = llm or LLM(cfg.model, dtype=cfg.dtype)
    target = llm.engine.runner.model
    corpus = load_or_generate_corpus(llm, cfg, out / "corpus.json")
    held_out, train_set = corpus[: cfg.held_out], corpus[cfg.held_out :]
    if not train_set:
        raise ValueError(
            f"the corpus has {len(corpus)} sequences: too few to hold {cfg.held_out} out"
        )
    features, greedy = target_features(llm, train_set)
    held_features, held_greedy = target_features(llm, held_out)
    counts = torch.bincount(torch.cat(greedy), minlength=target.config.vocab_size)
    trainer = HeadsTrainer(cfg, target, draft_vocabulary(counts, cfg.draft_vocab_size))
    AcceleratorState._reset_state(True)  # one per process: a second run may pick another precision
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=cfg.precision())
    optimizer = torch.optim.AdamW(trainer.module.parameters(), lr=cfg.lr, weight_decay=0.0)
    step = resume(out / "checkpoints", trainer.module, optimizer)
    if step == 0 and cfg.init_from is not None:
        start_from_heads(trainer.module, cfg.init_from, cfg.kind, target.config)
    module, optimizer = accelerator.prepare(trainer.module, optimizer)
    rng = random.Random(cfg.seed)
    schedule: list[list[int]] = []
    lengths = [len(s) for s in train_set]
    while len(schedule) < cfg.max_steps:  # epochs of batches, fixed by the seed: resumable
        schedule += _batches(lengths, cfg.batch_tokens, rng)
    tokens_seen = sum(lengths[i] for batch in schedule[:step] for i in batch)
    log = (out / "train_log.jsonl").open("a", encoding="utf-8")
    bar = tqdm(
        range(step, cfg.max_steps), initial=step, total=cfg.max_steps, desc=f"{cfg.kind} heads"
    )
    for step in bar:
        module.train()
        lr = (
            cfg.lr
            * min(1.0, (step + 1) / max(1, min(50, cfg.max_steps // 10)))  # warm-up
            * 0.5
            * (1 + math.cos(math.pi * step / cfg.max_steps))
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        with accelerator.autocast():
            loss, hits = trainer.losses(*_pad(train_set, features, greedy, schedule[step]))
        optimizer.zero_grad()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        tokens_seen += sum(lengths[i] for i in schedule[step])
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{hits[0][0] / max(1, hits[0][1]):.2f}")
        done = step + 1
        if done % cfg.save_every == 0 or done == cfg.max_steps:
            held_loss, accuracy = evaluate(trainer, held_out, held_features, held_greedy)
            record = {
                "step": done,
                "loss": loss.item(),
                "lr": lr,
                "tokens": tokens_seen,
                "held_out_loss": held_loss,
                "held_out_accuracy": accuracy,
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
            save_checkpoint(out / "checkpoints", done, trainer.module, optimizer)
    log.close()
    config = HeadsConfig.for_target(
        cfg.kind,
        target.config,
        draft_vocab_size=len(trainer.draft_vocab),
        num_heads=cfg.num_heads if cfg.kind == "medusa" else 1,
        target_name=llm.model_name,
        train_tokens=tokens_seen,
        train_steps=cfg.max_steps,
    )
    weights = {**trainer.module.state_dict(), "draft_vocab": trainer.draft_vocab}
    save_heads(out, config, weights)
    return out


@torch.no_grad()
def evaluate(
    trainer: HeadsTrainer,
    corpus: list[list[int]],
    features: list[torch.Tensor],
    greedy: list[torch.Tensor],
) -> tuple[float, list[float]]:
    """The mean loss and the top-1 accuracy per draft position on ``corpus`` (held out)."""
    trainer.module.eval()
    correct = [0] * trainer.num_positions
    counted = [0] * trainer.num_positions
    total = 0.0
    for i in range(len(corpus)):
        loss, hits = trainer.losses(*_pad(corpus, features, greedy, [i]))
        total += float(loss)
        for j, (c, n) in enumerate(hits):
            correct[j], counted[j] = correct[j] + c, counted[j] + n
    accuracy = [round(c / max(1, n), 4) for c, n in zip(correct, counted)]
    return round(total / max(1, len(corpus)), 5), accuracy
