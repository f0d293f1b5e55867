"""LoRA adapters served beside the base model, as vLLM serves them.

``LLM(enable_lora=True)`` and ``generate(..., lora_request=LoRARequest(name, id, path))`` run a
request through a PEFT adapter (``adapter_config.json`` and ``adapter_model.safetensors``, as
``peft``'s ``save_pretrained`` writes them) without touching the base weights: requests for
different adapters and for the base model share every step (see :mod:`specdec.models.lora`).
The options are vLLM's: ``max_loras`` adapters at most in one step (requests for another wait),
``max_lora_rank``, and ``max_cpu_loras`` adapters kept loaded (the least recently used one not in
use is let go to load another; a later request loads it again from its path).

Adapters of the decoder's linears are supported (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj``, in any subset, ranks per module included); anything
else in an adapter (embeddings, the LM head, biases, DoRA, ``modules_to_save``) is refused with
an error that names it, not ignored.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from specdec.models.lora import attach_lora, install_deltas, remove_deltas

if TYPE_CHECKING:
    from specdec.engine_config import EngineConfig
    from specdec.models.llama import LlamaForCausalLM

# PEFT's module names -> (our fused module under the layer, its part)
PARTS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Which adapter a request runs through (vLLM's ``LoRARequest``): a name, a positive id that
    identifies the adapter while it is loaded, and the directory of its PEFT files."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool):
            raise ValueError(f"lora_int_id must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be positive, got {self.lora_int_id}")
        if not isinstance(self.lora_path, (str, pathlib.Path)) or not str(self.lora_path):
            raise ValueError(f"lora_path must name the adapter's directory, got {self.lora_path!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return str(self.lora_path)


@dataclass(slots=True)
class LoadedAdapter:
    request: LoRARequest
    key: int  # the model's key for its deltas, new at every load (prefix-cache hashes use it)


def read_adapter(
    request: LoRARequest, model: LlamaForCausalLM, max_rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's deltas for the model's fused linears: module name -> (``A`` [R, in],
    ``B`` [out, R] with each part's scale folded in, block-diagonal over the parts), in the
    model's dtype. Raises ``ValueError`` for a missing or malformed adapter, one for another
    model's shapes, or one using what is not supported (see the module docstring)."""
    path = pathlib.Path(request.path)
    config = _read_config(path)
    tensors = _read_tensors(path)
    alpha = float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora", False))
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in PARTS:
            raise ValueError(
                f"LoRA adapter {request.name!r}: weight {key!r} is not one this engine applies "
                f"(adapters of the decoder's {', '.join(PARTS)} only)"
            )
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        parts.setdefault((layer, module), {})[which] = tensor
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {  # PEFT module -> (in, out)
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
    }  # fmt: skip
    fused: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(parts.items()):
        where = f"LoRA adapter {request.name!r}, layer {layer} {module}"
        if layer >= cfg.num_layers:
            raise ValueError(f"{where}: the model has {cfg.num_layers} layers")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: lora_A and lora_B must both be given")
        a, b = ab["A"].float(), ab["B"].float()
        rank, (n_in, n_out) = a.shape[0], shapes[module]
        if a.shape != (rank, n_in) or b.shape != (n_out, rank):
            raise ValueError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit this "
                f"model ({n_in} in, {n_out} out): an adapter for another model"
            )
        if rank > max_rank:
            raise ValueError(
                f"{where}: rank {rank} is greater than max_lora_rank {max_rank}; raise "
                "max_lora_rank"
            )
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        name, index = PARTS[module]
        fused.setdefault(f"layers.{layer}.{name}", []).append((index, a, b * scale))
    dtype = model.embed_tokens.weight.dtype
    return {name: _join(name, found, shapes, dtype) for name, found in fused.items()}


def _join(
    name: str,
    found: list[tuple[int, torch.Tensor, torch.Tensor]],
    shapes: dict[str, tuple[int, int]],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused module's ``A`` (the parts' stacked) and ``B`` (block-diagonal: each part's
    outputs read its own ranks only; a part the adapter leaves alone gets zero rows)."""
    modules = [m for m, (n, _) in PARTS.items() if name.endswith(n)]  # in fused order
    outs = [shapes[m][1] for m in modules]
    a = torch.cat([part[1] for part in found])
    b = torch.zeros(sum(outs), a.shape[0])
    rank_start = 0
    for index, part_a, part_b in found:
        row = sum(outs[:index])
        b[row : row + outs[index], rank_start : rank_start + part_a.shape[0]] = part_b
        rank_start += part_a.shape[0]
    return a.to(dtype), b.to(dtype)


def adapter_rank(path: str) -> int:
    """The highest rank of the PEFT LoRA adapter at ``path`` (ValueError if it is none this
    engine reads)."""
    config = _read_config(pathlib.Path(path))
    return max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])


def _read_config(path: pathlib.Path) -> dict[str, Any]:
    file = path / "adapter_config.json"
    if not file.is_file():
        raise ValueError(f"no LoRA adapter at {str(path)!r}: adapter_config.json not found")
    config = json.loads(file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type {config['peft_type']!r} is not LORA")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    used = [key for key, on in unsupported.items() if on]
    if used:
        raise ValueError(f"{file}: {', '.join(used)} not supported by this engine's LoRA")
    return config


def _read_tensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    file = path / "adapter_model.safetensors"
    if file.is_file():
        return safetensors.torch.load_file(file)
    legacy = path / "adapter_model.bin"
    if legacy.is_file():
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise ValueError(f"no LoRA weights in {str(path)!r}: adapter_model.safetensors not found")


class LoRAManager:
    """The adapters loaded into one model, by ``lora_int_id``, least recently used first."""

    def __init__(self, model: LlamaForCausalLM, max_rank: int, capacity: int):
        self.model, self.max_rank, self.capacity = model, max_rank, capacity
        self.models = [model]  # the target, then models that follow its adapters (drafts)
        self.loaded: OrderedDict[int, LoadedAdapter] = OrderedDict()
        self._next_key = 1

    def acquire(self, request: LoRARequest, in_use: set[int]) -> int:
        """The key of ``request``'s adapter, loading it (and letting go of the least recently
        used adapter whose key is not ``in_use``, where ``capacity`` are loaded) if needed."""
        adapter = self.loaded.get(request.adapter_id)
        if adapter is not None:
            if adapter.request.name != request.name:
                raise ValueError(
                    f"lora_int_id {request.adapter_id} is loaded as {adapter.request.name!r}, "
                    f"not {request.name!r}: give each adapter an id of its own"
                )
            self.loaded.move_to_end(request.adapter_id)
            return adapter.key
        weights = read_adapter(request, self.model, self.max_rank)  # before anything is let go
        if len(self.loaded) >= self.capacity:
            idle = [i for i, a in self.loaded.items() if a.key not in in_use]
            if not idle:
                raise ValueError(
                    f"all {self.capacity} loaded LoRA adapters are in use: raise max_cpu_loras, "
                    "or send this request once one is idle"
                )
            self.remove(idle[0], in_use)
        key, self._next_key = self._next_key, self._next_key + 1
        for model in self.models:
            install_deltas(model, key, weights)
        self.loaded[request.adapter_id] = LoadedAdapter(request, key)
        return key

    def remove(self, lora_int_id: int, in_use: set[int]) -> bool:
        """Let go of an adapter (False: none loaded with that id); refused (``ValueError``)
        while its key is ``in_use`` by unfinished requests."""
        adapter = self.loaded.get(lora_int_id)
        if adapter is None:
            return False
        if adapter.key in in_use:
            raise ValueError(f"LoRA adapter {lora_int_id} is in use by unfinished requests")
        del self.loaded[lora_int_id]
        for model in self.models:
            remove_deltas(model, adapter.key)
        return True

    def follow(self, model: LlamaForCausalLM | None) -> None:
        """Install every adapter in ``model`` too (a draft of the target's shapes), from now on;
        ``None``: nothing to follow."""
        if model is not None:
            attach_lora(model)
            self.models.append(model)


def lora_manager(model: LlamaForCausalLM, config: EngineConfig) -> LoRAManager | None:
    """The engine's adapters under ``enable_lora`` (None without it); the model's linears are
    wrapped for them now. Refused on CUDA, where the deltas have not been checked yet."""
    if not config.enable_lora:
        return None
    if model.embed_tokens.weight.device.type != "cpu":
        raise ValueError("enable_lora runs on the CPU only for now; pass device='cpu'")
    attach_lora(model)
    capacity = config.max_cpu_loras or config.max_loras
    return LoRAManager(model, config.max_lora_rank, capacity)
