"""What the self-drafting heads (drafters/medusa.py, drafters/eagle.py) share: their saved form,
the check that they fit the target, and the reduced draft vocabulary.

A heads directory holds ``config.json`` (:class:`HeadsConfig`) and ``heads.safetensors`` (the
trained weights, and ``draft_vocab``: the target token ids of the reduced vocabulary). The
output layer over the reduced vocabulary is not stored: it is the target's own output rows for
those ids, taken at load time and never trained, so heads stay small and always score tokens
as the target does.

*Reduced draft vocabulary* (EAGLE-3, Li et al. 2025): the ``draft_vocab_size`` tokens most
frequent in the training data. In the default model the tied output layer is 28M of 135M
parameters, so a draft step through it would read a fifth of the target's weights; through
8,192 of its 49,152 rows, a sixth of that. A token outside the reduced vocabulary is never
drafted (it can still be emitted: the target's verification samples from the full vocabulary).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specdec.models.linear import fast_linears
from specdec.models.llama import ModelArchConfig
from specdec.sampling import row_argmax
from specdec.sequence import Sequence
from specdec.verifier import draft_tokens, plain_greedy

CONFIG_FILE, WEIGHTS_FILE = "config.json", "heads.safetensors"
DEFAULT_HEADS_DIR = Path(__file__).parent / "data" / "heads"  # shipped heads, by kind


@dataclass(slots=True)
class HeadsOptions:
    """The options of a heads drafter (``SpecConfig("eagle", heads=DIR)``)."""

    heads: str | os.PathLike | None = None  # a heads directory; None: the shipped default's


@dataclass(slots=True)
class HeadsConfig:
    """The shape of a set of heads, and of the target they were trained for."""

    kind: str  # "medusa" or "eagle"
    hidden_size: int  # the target's hidden size
    vocab_size: int  # the target's vocabulary
    num_target_layers: int  # the target's decoder layers
    draft_vocab_size: int  # tokens in the reduced draft vocabulary
    num_heads: int = 4  # medusa: heads, each drafting one position further; eagle: 1
    target_name: str = ""  # the model they were trained on, for messages
    train_tokens: int = 0  # training tokens seen
    train_steps: int = 0  # optimizer steps taken

    def check_target(self, target: ModelArchConfig) -> None:
        """Refuse heads trained for a model of another shape."""
        ours = (self.hidden_size, self.vocab_size, self.num_target_layers)
        theirs = (target.hidden_size, target.vocab_size, target.num_layers)
        if ours != theirs:
            raise ValueError(
                f"these {self.kind} heads were built for a model with hidden size {ours[0]}, "
                f"a vocabulary of {ours[1]} and {ours[2]} layers ({self.target_name or 'unnamed'})"
                f"; the target has hidden size {theirs[0]}, {theirs[1]} tokens and {theirs[2]} "
                f"layers: train heads for it with `specdec train-heads`"
            )

    @staticmethod
    def for_target(kind: str, target: ModelArchConfig, **fields: Any) -> HeadsConfig:
        return HeadsConfig(kind, target.hidden_size, target.vocab_size, target.num_layers, **fields)


def save_heads(
    directory: str | os.PathLike, config: HeadsConfig, weights: dict[str, torch.Tensor]
) -> None:
    """Write ``config`` and ``weights`` (bfloat16 for float tensors: half the size, and heads
    only propose, so their rounding never reaches the output) to ``directory``."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    stored = {
        name: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
        for name, t in weights.items()
    }
    save_file(stored, str(path / WEIGHTS_FILE))
    text = json.dumps(dataclasses.asdict(config), indent=1)
    (path / CONFIG_FILE).write_text(text + "\n", encoding="utf-8")


def load_heads(
    directory: str | os.PathLike, kind: str, dtype: torch.dtype
) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    """The config and weights saved in ``directory`` (float weights cast to ``dtype``)."""
    path = Path(directory)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ValueError(
            f"{path} holds no {kind} heads (expected {CONFIG_FILE} and {WEIGHTS_FILE}); "
            f"make them with `specdec train-heads --kind {kind} --out {path}`"
        )
    fields = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    known = {f.name for f in dataclasses.fields(HeadsConfig)}
    config = HeadsConfig(**{k: v for k, v in fields.items() if k in known})
    if config.kind != kind:
        raise ValueError(f"{path} holds {config.kind} heads, not {kind} heads")
    weights = load_file(str(path / WEIGHTS_FILE))
    cast = {n: t.to(dtype) if t.is_floating_point() else t for n, t in weights.items()}
    return config, cast


def load_for_target(
    options: HeadsOptions, kind: str, model: Any, make: Any
) -> tuple[torch.nn.Module, DraftVocabHead]:
    """The ``kind`` heads ``options`` names (default: the shipped ones), checked against the
    target ``model``, built by ``make(config)``, loaded frozen in the target's dtype; and the
    target's output rows over their draft vocabulary."""
    dtype = model.embed_tokens.weight.dtype
    config, weights = load_heads(options.heads or default_heads(kind), kind, dtype)
    config.check_target(model.config)
    module = make(config)
    module.load_state_dict({n: t for n, t in weights.items() if n != "draft_vocab"})
    module.to(device=model.embed_tokens.weight.device, dtype=dtype)  # where the target runs
    module.eval().requires_grad_(False)
    return fast_linears(module), DraftVocabHead(model, weights["draft_vocab"])


def start_from_heads(
    module: torch.nn.Module, directory: str | os.PathLike, kind: str, target: ModelArchConfig
) -> None:
    """Load the ``kind`` heads saved in ``directory`` into ``module``, to train on from there;
    heads made for another target, or of another shape, are refused."""
    config, weights = load_heads(directory, kind, torch.float32)
    config.check_target(target)
    try:
        module.load_state_dict({n: t for n, t in weights.items() if n != "draft_vocab"})
    except RuntimeError as error:
        first = str(error).splitlines()[1:2] or [str(error)]
        raise ValueError(
            f"the {kind} heads in {directory} do not fit this run ({first[0].strip()}); "
            "start them from scratch, or give the options they were trained with"
        ) from None


def default_heads(kind: str) -> Path:
    """The shipped heads of ``kind`` for the default model."""
    return DEFAULT_HEADS_DIR / kind


def draft_vocabulary(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids (ties to the lower id), sorted by id; [size]."""
    size = min(size, len(token_counts))
    order = torch.argsort(-token_counts.double() + torch.arange(len(token_counts)) * 1e-9)
    return order[:size].sort().values


@torch.inference_mode()
def output_rows(model: Any) -> torch.Tensor:
    """The target's output layer as a ``[V, H]`` matrix, however it is stored (packed for the
    row kernels, quantized, tied to the embedding): its logits for the unit vectors."""
    cfg, weight = model.config, model.embed_tokens.weight
    eye = torch.eye(cfg.hidden_size, dtype=weight.dtype, device=weight.device)
    return model.compute_logits(eye).T.contiguous().clone()


class DraftVocabHead:
    """The target's output layer restricted to the draft vocabulary, and the way back to
    target ids. ``weight`` is a copy of the target's rows (``[draft_vocab_size, hidden]``)."""

    def __init__(self, target: Any, draft_vocab: torch.Tensor):
        rows = output_rows(target)
        self.draft_vocab = draft_vocab.long().to(rows.device)  # [Vd] target ids
        self.weight = rows[self.draft_vocab].contiguous()  # [Vd, H]
        self.vocab_size = rows.shape[0]
        size, hidden = self.weight.shape
        linear = torch.nn.Linear(hidden, size, bias=False, device="meta")
        linear.weight = torch.nn.Parameter(self.weight, requires_grad=False)
        # drafting's largest matrix, on the fast kernels (they swap a module's children)
        self.linear = fast_linears(torch.nn.Sequential(linear))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, Vd] float32
        return self.linear(hidden).float()

    def _full(self, small: torch.Tensor) -> torch.Tensor:  # [N, Vd] -> [N, V]
        """Logits over the target's vocabulary: -inf outside the draft vocabulary, so that the
        target's sampling rule (and its noise) picks among draft tokens only."""
        full = torch.full((len(small), self.vocab_size), float("-inf"), device=small.device)
        full[:, self.draft_vocab] = small
        return full

    def draft(self, hidden: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Each sequence's next draft from the head's output ``hidden`` ([len(seqs), H]), by the
        target's rule (:func:`~specdec.verifier.draft_tokens` over the full vocabulary). When every
        row is greedy with nothing to constrain it, that rule is the argmax of the draft
        vocabulary's logits (its ids ascend, so ties fall as over the full row), taken without
        building the full rows."""
        small = self.logits(hidden)
        if plain_greedy(seqs):
            return self.draft_vocab[row_argmax(small)].tolist()
        return draft_tokens(self._full(small), seqs)
