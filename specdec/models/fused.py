"""A step of decodes and verifications through every decoder layer in one C++ call.

:class:`FusedStack` hands the model's layers to ``DecoderStack`` (``kernels/cpu_stack.cpp``)
once, and then runs each eligible step there: the ops of
:meth:`specdec.models.llama.DecoderLayer.forward`, in its order, on its kernels, so every row
gets the bits the Python path gives it (``tests/models/test_fused.py`` compares them bit for
bit). What it saves is the Python between the kernels: side by side, a single-stream decode
step of the default model took 5.3 ms on the Python layers and 3.7 ms on the stack (bfloat16 with
``w4a8`` weights), 21.9 and 18.7 ms in float32 (see the README).

A step is eligible when it holds decodes and verifications only (one group of queries of at
most ``NARROW_QUERY`` each, attended by the C++ kernel), on a model whose every decoder linear
runs one of the three kernels: float32 packed in lanes, bfloat16 packed in pairs, or quantized.
Anything else (prompt chunks, oneDNN's packed bf16, CUDA) runs the Python layers as before.
``SPECDEC_FUSED_STACK=0`` turns it off. LoRA adapters' deltas (:mod:`specdec.models.lora`) run
in the stack too, on the same kernels and in the same order as ``LoRALinear``'s: each adapter
loaded is handed to the stack (:meth:`FusedStack.add_adapter`), and each step passes its
adapters' rows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from specdec.attention import NARROW_QUERY, AttentionMetadata
from specdec.kernels import cpu_ops
from specdec.models.linear import RowLinear
from specdec.models.quant import QuantLinear

if TYPE_CHECKING:
    from specdec.models.llama import LlamaForCausalLM, Rope

LoRASteps = Sequence[tuple[int, torch.Tensor | None]]  # adapter key, its rows (None: all)
FUSED_STACK_ENV = "SPECDEC_FUSED_STACK"  # "0": every step runs the Python layers
LANES, PAIRS, QUANT = 0, 1, 2  # cpu_stack.cpp's StackLinear kinds


def enabled() -> bool:
    return os.environ.get(FUSED_STACK_ENV, "1") != "0"


class FusedStack:
    """The C++ decoder stack of one model, rebuilt when the runner hands it other KV tensors."""

    def __init__(self, model: LlamaForCausalLM, kernels: Any, linears: list[list[Any]]):
        self.model, self.kernels, self.linears = model, kernels, linears
        self.attentions = model.attention_layers  # the layers whose K/V tensors the stack holds
        self.caches: list[torch.Tensor] = []  # the K/V tensors the stack was built with
        self.stack: Any = None
        self.adapters: dict[int, list[Any]] = {}  # LoRA adapter key -> its AdapterLayers

    @staticmethod
    def build(model: LlamaForCausalLM) -> FusedStack | None:
        """The stack for ``model``, or None where one of its linears has no kernel here."""
        kernels = cpu_ops.extension()
        if kernels is None or model.embed_tokens.weight.device.type != "cpu":
            return None
        linears = []
        layers: list[Any] = list(model.layers)
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            converted = [_stack_linear(kernels, m, model.embed_tokens.weight.dtype) for m in parts]
            if any(c is None for c in converted):
                return None
            linears.append(converted)
        return FusedStack(model, kernels, linears)

    def eligible(self, x: torch.Tensor, meta: AttentionMetadata, lora_rows: LoRASteps) -> bool:
        """Whether this step is one the stack runs (see the module docstring), its adapters
        (``lora_rows``) all handed to the stack."""
        if meta.fresh_ranges or len(meta.groups) != 1:
            return False
        if any(key not in self.adapters for key, _ in lora_rows):
            return False
        if cpu_ops.extension_for(x) is None:  # the layer ops would not take the kernels either
            return False
        group = meta.groups[0]
        return group.block_tables is None and (
            meta.invariant or group.query_index.shape[1] <= NARROW_QUERY
        )

    def forward(
        self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata, lora_rows: LoRASteps = ()
    ) -> torch.Tensor:
        """The final hidden states of the step's tokens, embedded as ``x`` [N, hidden], with
        each adapter of ``lora_rows`` on its rows."""
        stack = self._current()
        group = meta.groups[0]
        return stack.forward(
            x, rope[0], rope[1], meta.slot_mapping, group.query_index, group.key_slots,
            group.query_lens, group.context_lens, group.valid_index, group.valid_rows, meta.dense,
            [key for key, _ in lora_rows], [rows for _, rows in lora_rows],
        )  # fmt: skip

    def add_adapter(self, key: int, deltas: list[list[tuple[Any, Any] | None]]) -> None:
        """Run LoRA adapter ``key`` in the stack: per layer, its (down, up) modules on the
        qkv, o, gate_up and down linears (None: that linear is left alone). An adapter whose
        modules are not on the stack's kernels is not handed over (its steps run in Python)."""
        dtype = self.model.embed_tokens.weight.dtype
        layers = []
        for layer in deltas:
            parts = []
            for pair in layer:
                converted = (
                    None if pair is None else [_stack_linear(self.kernels, m, dtype) for m in pair]
                )
                if converted is not None and None in converted:
                    return
                parts.append(None if converted is None else self.kernels.StackDelta(*converted))
            layers.append(self.kernels.AdapterLayer(*parts))
        self.adapters[key] = layers
        self.stack = None  # rebuilt with it on the next step

    def remove_adapter(self, key: int) -> None:
        if self.adapters.pop(key, None) is not None:
            self.stack = None

    def _current(self) -> Any:
        # Called every step: a walk over the layers kept at build time, not the model's
        # attention_layers (a list built per call, 24 us of a 35 us check).
        if self.stack is None or any(
            a.k_cache is not k or a.v_cache is not v
            for a, k, v in zip(self.attentions, self.caches[::2], self.caches[1::2])
        ):
            self.caches = [t for a in self.attentions for t in (a.k_cache, a.v_cache)]
            cfg, model, k = self.model.config, self.model, self.kernels
            decoder_layers: list[Any] = list(model.layers)
            layers = [
                k.StackLayer(
                    layer.input_layernorm.weight,
                    layer.post_attention_layernorm.weight,
                    *linears,
                    layer.self_attn.k_cache,
                    layer.self_attn.v_cache,
                    *_head_norm_weights(layer.self_attn),
                )
                for layer, linears in zip(decoder_layers, self.linears)
            ]
            attn = self.attentions[0]
            self.stack = k.DecoderStack(
                layers, model.norm.weight, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                attn.scale, cfg.rms_norm_eps, self.adapters,
            )  # fmt: skip
        return self.stack


def _stack_linear(kernels: Any, module: Any, dtype: torch.dtype) -> Any:
    """``module`` as a StackLinear, or None if it does not run on one of the kernels."""
    if isinstance(module, QuantLinear):
        p = module.packed
        bias = None if module.bias is None else module.bias.to(dtype)  # as its forward casts it
        return kernels.StackLinear(
            QUANT, p.codes, p.scales, p.extra, bias, p.bits, p.out_features, p.int8_activations
        )
    if isinstance(module, RowLinear):
        kind = LANES if module.layout == "lanes" else PAIRS
        return kernels.StackLinear(
            kind, module.packed, None, None, module.bias, 0, module.out_features, False
        )
    return None


def _head_norm_weights(attention: Any) -> list[torch.Tensor | None]:  # noqa: ANN401
    """The weights of an attention layer's per-head query and key norms (Qwen3's), or None."""
    return [None if n is None else n.weight for n in (attention.q_norm, attention.k_norm)]
