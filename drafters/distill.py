"""Derive a small draft model from the target: keep a few of its layers, then distil briefly.

    python -m specdec.drafters.distill --layers 4 --out ~/.cache/specdec/drafts/smollm2-l4

The draft keeps the target's embeddings, final norm and tied output head (frozen: the vocabulary
and output space stay the target's) and ``--layers`` of its decoder layers, evenly spaced from
the first to the last (layer skipping, as in LayerSkip / self-speculative decoding, Zhang et al.
2023). It is then trained for a few epochs on text the target itself generates for the prompts
of ``eval/prompts/distill.jsonl`` (sequence-level knowledge distillation, Kim & Rush 2016): the
draft learns to predict the target's own next tokens, which is what verification rewards. The
evaluation prompt sets are never used for training. The result is a Hugging Face directory that
``SpecConfig(drafter="draft_model", draft_model=DIR)`` loads.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from specdec import LLM, SamplingParams
from specdec.eval.prompts import conversation, load_prompts
from specdec.loader import default_model_dir


def generate_corpus(llm: LLM, samples_per_prompt: int, max_tokens: int) -> list[list[int]]:
    """Prompt + target continuation token ids, sampled at a low temperature for variety."""
    prompts = [llm.apply_chat_template(conversation(r)) for r in load_prompts("distill")]
    params = [
        SamplingParams(temperature=0.3, max_tokens=max_tokens, seed=s)
        for _ in prompts
        for s in range(samples_per_prompt)
    ]
    inputs = [p for p in prompts for _ in range(samples_per_prompt)]
    outputs = llm.generate(inputs, params)
    return [o.prompt_token_ids + o.token_ids for o in outputs]


def truncated_copy(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """The target with only ``num_layers`` decoder layers, evenly spaced, first and last kept."""
    total = target.config.num_hidden_layers
    keep = sorted({round(i * (total - 1) / max(1, num_layers - 1)) for i in range(num_layers)})
    draft = copy.deepcopy(target)
    draft.model.layers = torch.nn.ModuleList(draft.model.layers[i] for i in keep)
    for new_index, layer in enumerate(draft.model.layers):
        layer.self_attn.layer_idx = new_index
    draft.config.num_hidden_layers = len(keep)
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = [draft.config.layer_types[i] for i in keep]
    return draft


def train(
    draft: PreTrainedModel, corpus: list[list[int]], epochs: int, lr: float, batch_tokens: int
) -> None:
    """Next-token cross-entropy on the target's text; embeddings and head stay frozen."""
    draft.train()
    draft.get_input_embeddings().weight.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    for epoch in range(epochs):
        order = torch.randperm(len(corpus), generator=generator).tolist()
        total, count, start = 0.0, 0, time.perf_counter()
        for batch in _batches([corpus[i] for i in order], batch_tokens):
            ids, mask = _pad(batch)
            labels = ids.masked_fill(mask == 0, -100)
            loss = draft(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            total, count = total + float(loss), count + 1
        print(f"epoch {epoch + 1}: loss {total / count:.3f} ({time.perf_counter() - start:.0f} s)")
    draft.eval()


def _batches(seqs: list[list[int]], batch_tokens: int):  # noqa: ANN202
    batch: list[list[int]] = []
    for seq in seqs:
        if batch and (len(batch) + 1) * max(len(s) for s in [*batch, seq]) > batch_tokens:
            yield batch
            batch = []
        batch.append(seq)
    if batch:
        yield batch


def _pad(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(s) for s in batch)
    ids = torch.tensor([s + [0] * (longest - len(s)) for s in batch])
    mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in batch])
    return ids, mask


@torch.no_grad()
def agreement(draft: PreTrainedModel, target: PreTrainedModel, corpus: list[list[int]]) -> float:
    """How often the draft's argmax equals the target's on held-out text (greedy acceptance)."""
    same = total = 0
    for seq in corpus:
        ids = torch.tensor([seq])
        a = draft(input_ids=ids).logits.argmax(-1)
        b = target(input_ids=ids).logits.argmax(-1)
        same, total = same + int((a == b).sum()), total + a.numel()
    return same / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write the draft to")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples-per-prompt", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    args = parser.parse_args()
    torch.manual_seed(0)
    llm = LLM()
    print("generating the target's text ...", flush=True)
    corpus = generate_corpus(llm, args.samples_per_prompt, args.max_tokens)
    held_out, corpus = corpus[:8], corpus[8:]
    target = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    draft = truncated_copy(target, args.layers)
    print(f"greedy agreement before training: {agreement(draft, target, held_out):.3f}")
    train(draft, corpus, args.epochs, args.lr, args.batch_tokens)
    print(f"greedy agreement after training: {agreement(draft, target, held_out):.3f}")
    draft.save_pretrained(args.out)
    llm.tokenizer.save_pretrained(args.out)
    print(f"draft model written to {args.out}")


if __name__ == "__main__":
    main()
