"""A forward that also keeps what transformers' ``output_hidden_states`` and
``output_attentions`` give: chosen rows' states after every decoder layer, and their attention
probabilities, for requests with ``SamplingParams.return_hidden_states`` or
``return_attentions``.

It runs :class:`~specdec.models.llama.LlamaForCausalLM`'s Python layers, whose bits the fused
stack gives (``tests/models/test_fused.py``), so the step's logits, and every request's tokens,
are those of the usual forward. The probabilities are computed beside the step, from each
layer's input at the kept rows and the keys the step has just cached: the paged attention
kernels never form them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.kernels import cpu_ops

if TYPE_CHECKING:
    from specdec.attention import AttentionMetadata
    from specdec.models.llama import Attention, DecoderLayer, LlamaForCausalLM, Rope


@dataclass(slots=True)
class AttentionProbe:
    """Rows of one sequence in a step whose attention probabilities are kept."""

    rows: torch.Tensor  # [n] their flat rows in the step
    kept: torch.Tensor  # [n] their indices among the rows whose states are kept
    positions: torch.Tensor  # [n] their positions
    key_slots: torch.Tensor  # [T] cache slots of the sequence's positions 0 .. T - 1


def forward_with_layers(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,  # [N]
    positions: torch.Tensor,  # [N]
    meta: AttentionMetadata,
    rows: torch.Tensor,  # [R] the tokens whose states are kept
    probes: list[AttentionProbe] | None = None,  # whose attention probabilities are kept
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``model.forward`` on its Python layers, returning its hidden states [N, hidden], and
    ``rows``' states [layers + 1, R, hidden]: the embeddings, each layer's output but the last,
    then the final norm's (transformers' layout); and per probe its rows' attention
    probabilities, [layers, heads, n, T]."""
    x = model.embed_tokens(input_ids)
    rope = model.rope(positions, x.dtype)
    kept = [x[rows]]
    attentions: list[list[torch.Tensor]] = [[] for _ in probes or ()]
    residual = None
    layers: list[DecoderLayer] = list(model.layers)  # type: ignore[arg-type]
    for i, layer in enumerate(layers):
        x, residual = layer.forward(x, residual, rope, meta)  # its K now in the cache
        for probe, probs in zip(probes or (), attentions):
            probs.append(_layer_probabilities(layer, kept[i][probe.kept], rope, probe))
        if i + 1 < len(layers):
            kept.append(x[rows] + residual[rows])  # the residual add is still to come
    hidden = model.norm.forward(x, residual)
    kept.append(hidden[rows])
    return hidden, torch.stack(kept), [torch.stack(p) for p in attentions]


def _layer_probabilities(
    layer: DecoderLayer,
    state: torch.Tensor,  # [n, hidden] the layer's input (before its norm) at the probe's rows
    rope: Rope,  # the step's
    probe: AttentionProbe,
) -> torch.Tensor:  # [heads, n, T] float32, zero past each row's position
    """The probe's attention probabilities in ``layer`` over the sequence's cached keys: the
    softmax of the scaled query-key products, causal (each key head serving its group of
    query heads)."""
    attn: Attention = layer.self_attn  # type: ignore[assignment]
    n, heads, kv_heads, dim = state.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = attn.qkv_proj.forward(layer.input_layernorm.forward(state))
    cpu_ops.rope_(qkv, rope[0][probe.rows], rope[1][probe.rows], heads + kv_heads, dim)
    q = qkv.view(n, -1, dim)[:, :heads].float()
    keys = attn.k_cache.view(-1, kv_heads, dim)[probe.key_slots].float()
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # [T, heads, D]
    scores = torch.einsum("nhd,thd->hnt", q, keys) * attn.scale
    future = (
        torch.arange(len(probe.key_slots), device=state.device)[None] > probe.positions[:, None]
    )
    return scores.masked_fill_(future, float("-inf")).softmax(dim=-1)
