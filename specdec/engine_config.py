"""How the engine is sized and where it runs: :class:`EngineConfig` and :func:`resolve_device`.

Validated on construction, as :class:`~specdec.config.SamplingParams` is, so a bad value fails
where it is written with a ``ValueError`` that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from specdec.config import _check

SCHEDULING_POLICIES = ("fcfs", "priority")
POOLING_TYPES = ("last", "mean", "cls")  # see specdec.pooling


@dataclass(slots=True)
class EngineConfig:
    """How the engine is sized. Terms follow vLLM: a *block* holds ``block_size`` tokens of KV."""

    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV pool size; None derives it from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0  # memory for target KV when num_kv_blocks is None
    max_num_seqs: int = 64  # most sequences running in one step
    max_num_batched_tokens: int = 1024  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # longest prompt + output; None takes the model's limit
    enable_prefix_caching: bool = True  # reuse full KV blocks across requests by content hash
    # Every row's result independent of the rest of the step (bit-exact speculation, logprobs
    # included); None: on where the CPU kernels have vector code (AVX-512, or AVX2 and FMA).
    batch_invariant: bool | None = None
    device: str = "auto"  # "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N"
    # CUDA: the share of the device's memory the engine may hold (weights, activations and the
    # KV pool, sized from what is left when num_kv_blocks is None), as vLLM's option
    gpu_memory_utilization: float = 0.9
    # CUDA: decode and verification steps replay captured CUDA graphs (see specdec.cuda_graphs)
    cuda_graphs: bool = False
    # requests without SamplingParams.seed take noise seeds drawn from a generator seeded with
    # this, so a rerun repeats them (vLLM's LLM(seed=)); None: drawn from torch's global RNG
    seed: int | None = None
    # "fcfs": requests run in arrival order, and the newest running one is preempted first;
    # "priority": by each request's priority (lower first), then arrival, and the running one
    # last in that order is preempted first (vLLM's scheduling_policy)
    scheduling_policy: str = "fcfs"
    # how an embedding request's prompt states are pooled (see specdec.pooling): "last" (vLLM's
    # default for a decoder-only model), "mean" or "cls" (vLLM's pooler_config pooling_type)
    pooling_type: str = "last"
    # LoRA adapters (see specdec.lora; vLLM's options): requests may name an adapter; at most
    # max_loras adapters in one step, of rank at most max_lora_rank, and max_cpu_loras kept
    # loaded (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> EngineConfig:
        """The config of ``LLM``'s keyword options; an unknown one (vLLM has many that mean
        nothing here) raises a TypeError that names it and lists the known ones."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(
                f"LLM got unknown option(s) {', '.join(map(repr, unknown))}; its engine options "
                f"are {', '.join(known)}"
            )
        return cls(**options)

    def __post_init__(self) -> None:
        _check(self.block_size > 0, f"block_size must be positive, got {self.block_size}")
        _check(
            self.num_kv_blocks is None or self.num_kv_blocks > 0,
            f"num_kv_blocks must be positive, got {self.num_kv_blocks}",
        )
        _check(
            self.kv_cache_memory_gb > 0,
            f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}",
        )
        _check(self.max_num_seqs > 0, f"max_num_seqs must be positive, got {self.max_num_seqs}")
        _check(
            self.max_num_batched_tokens > 0,
            f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}",
        )
        _check(
            self.max_model_len is None or self.max_model_len > 1,
            f"max_model_len must be at least 2, got {self.max_model_len}",
        )
        _check(
            0 < self.gpu_memory_utilization <= 1,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
            f"seed must be an integer or None, got {self.seed!r}",
        )
        _check(
            self.scheduling_policy in SCHEDULING_POLICIES,
            f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got "
            f"{self.scheduling_policy!r}",
        )
        _check(
            self.pooling_type in POOLING_TYPES,
            f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}",
        )
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            _check(value > 0, f"{name} must be positive, got {value}")
        _check(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})",
        )
        resolve_device(self.device)  # a bad name fails here, where it was written


def resolve_device(name: str | torch.device) -> torch.device:
    """The device ``name`` stands for: ``"auto"`` is CUDA when torch sees a GPU, else the CPU.

    Raises ``ValueError`` for an unknown name, or for CUDA where torch has none (a CPU build of
    torch, or no visible GPU)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}"
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"device {name!r}: this torch sees no CUDA GPU (torch {torch.__version__}; a CPU "
                "build of torch, or no visible device); use device='cpu' or 'auto'"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {name!r}: torch sees {count} CUDA device(s)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device
