"""LoRA deltas on the native model's linears, several adapters in one step.

LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") adapts a linear
``y = W x`` to ``y = W x + s B A x`` with ``A`` [r, in] and ``B`` [out, r] of a small rank ``r``.
Serving keeps ``W`` shared and adds each sequence's own ``s B A x`` to its rows, as vLLM's
multi-LoRA serving (after Punica, Chen et al., 2023) does, so that requests for different adapters
and for the base model share one step. Here each adapted linear is wrapped in a
:class:`LoRALinear`; the runner tells the model's :class:`LoRARows` which rows of the step belong
to which adapter, and each adapter present adds its delta to its rows: gathered, two small
matmuls, added back.

The model's q/k/v and gate/up projections are fused, so an adapter's parts for them are joined:
``A`` stacked ([r_q + r_k + r_v, in]) and ``B`` block-diagonal, with the scale folded in. The
small matmuls run on the same kernels as the base linears (:mod:`specdec.models.linear`), the
row-invariant ones in a batch-invariant model, and the delta is added row by row, so a row's
result does not depend on the rest of the step: speculative decoding with an adapter gives the
adapter's plain decoding exactly, as it does for the base model. Decode and verification steps
run the same deltas in the C++ decoder stack (:mod:`specdec.models.fused`), with the same bits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from specdec.models.linear import prepack_linears, use_row_kernels

if TYPE_CHECKING:
    from specdec.models.llama import LlamaForCausalLM
    from specdec.runner import QueryChunk

# the wrapped linears of each decoder layer, by their path under the layer
ADAPTED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass(slots=True)
class LoRARows:
    """Which rows of the current step each adapter takes, shared by a model's LoRA linears:
    (adapter key, row indices, or None for every row). Empty outside a step with adapters."""

    rows: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    linears: dict[str, LoRALinear] = field(default_factory=dict)  # module name -> linear


class LoRALinear(nn.Module):
    """A base linear plus the deltas of the adapters loaded for it (see the module docstring)."""

    def __init__(self, base: nn.Module, rows: LoRARows):
        super().__init__()
        self.base = base
        self.step = rows
        # adapter key -> (down [in -> r], up [r -> out]); a plain dict, so that the deltas are
        # not submodules (not weights of the model, and never swapped by use_row_kernels again)
        self.deltas: dict[int, tuple[nn.Module, nn.Module]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        y = self.base.forward(x)
        for key, rows in self.step.rows:
            delta = self.deltas.get(key)
            if delta is None:  # the adapter leaves this linear alone
                continue
            down, up = delta
            if rows is None:
                y += up.forward(down.forward(x))
            else:
                y.index_add_(0, rows, up.forward(down.forward(x.index_select(0, rows))))
        return y


def lora_rows(chunks: list[QueryChunk]) -> list[tuple[int, torch.Tensor | None]]:
    """Each adapter of a step and the flat rows of its chunks' tokens (None: all of them)."""
    ranges: dict[int, list[range]] = {}
    end = 0
    for chunk in chunks:
        start, end = end, end + len(chunk.token_ids)
        if chunk.lora_key:
            ranges.setdefault(chunk.lora_key, []).append(range(start, end))
    if len(ranges) == 1 and sum(map(len, next(iter(ranges.values())))) == end:
        return [(next(iter(ranges)), None)]  # one adapter takes the whole step
    return [
        (key, torch.tensor([row for r in spans for row in r], dtype=torch.long))
        for key, spans in ranges.items()
    ]


@contextlib.contextmanager
def adapter_rows(model: LlamaForCausalLM, chunks: list[QueryChunk]) -> Iterator[None]:
    """While a forward of ``chunks`` runs, the model's LoRA linears know each adapter's rows."""
    lora = model.lora
    if lora is None:
        yield
        return
    lora.rows = lora_rows(chunks)
    try:
        yield
    finally:
        lora.rows = []


def attach_lora(model: LlamaForCausalLM) -> LoRARows:
    """Wrap every adaptable linear of ``model`` (a LlamaForCausalLM) once; return the rows
    object its LoRA linears share (the model's ``lora``)."""
    if model.lora is not None:
        return model.lora
    rows = LoRARows()
    for i, layer in enumerate(model.layers):
        for path in ADAPTED:
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)  # the layer's self_attn or mlp
            wrapped = LoRALinear(getattr(owner, attr), rows)
            setattr(owner, attr, wrapped)
            rows.linears[f"layers.{i}.{path}"] = wrapped
    model.lora = rows
    return rows


def install_deltas(
    model: LlamaForCausalLM, key: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Give the model's LoRA linears adapter ``key``'s deltas: module name -> (``A`` [r, in],
    ``B`` [out, r] with the scale folded in), in the model's dtype, on the model's kernels."""
    rows = attach_lora(model)
    invariant, dtype = bool(model.batch_invariant), model.embed_tokens.weight.dtype
    installed: dict[str, tuple[nn.Module, nn.Module]] = {}
    for name, (a, b) in weights.items():
        down = nn.Linear(a.shape[1], a.shape[0], bias=False, device="meta")
        up = nn.Linear(b.shape[1], b.shape[0], bias=False, device="meta")
        down.weight = nn.Parameter(a.to(dtype).contiguous(), requires_grad=False)
        up.weight = nn.Parameter(b.to(dtype).contiguous(), requires_grad=False)
        pair = nn.ModuleList([down, up])
        use_row_kernels(pair, invariant=True)  # row kernels wherever built: fast at rank r
        prepack_linears(pair, invariant=invariant)  # else oneDNN (bf16), in invariant tiles
        rows.linears[name].deltas[key] = installed[name] = (pair[0], pair[1])
    if model.fused is not None:  # the C++ stack runs the adapter's decode steps too
        names = [[f"layers.{i}.{path}" for path in ADAPTED] for i in range(len(model.layers))]
        model.fused.add_adapter(key, [[installed.get(n) for n in layer] for layer in names])


def remove_deltas(model: LlamaForCausalLM, key: int) -> None:
    """Drop adapter ``key``'s deltas from every LoRA linear."""
    for linear in attach_lora(model).linears.values():
        linear.deltas.pop(key, None)
    if model.fused is not None:
        model.fused.remove_adapter(key)
