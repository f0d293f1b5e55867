"""The dtypes a model runs in: float32 or bfloat16, or ``"auto"``, the model's own."""

from __future__ import annotations

import json
import os
import pathlib

import torch
import transformers

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: torch.dtype | str, model: object = None) -> torch.dtype:
    """The torch dtype for ``dtype`` ("float32"/"fp32"/"bfloat16"/"bf16" or a torch dtype).

    ``"auto"`` (vLLM's default) takes ``model``'s own: an in-memory model's dtype, or a model
    directory's ``torch_dtype``; float16 becomes bfloat16 (the CPU kernels have no float16
    path), and a GGUF file, the default model or a directory that names none gets float32.
    """
    allowed = (torch.float32, torch.bfloat16)
    if dtype == "auto":
        own = _own_dtype(model)
        return torch.bfloat16 if own in (torch.bfloat16, torch.float16) else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in allowed:
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"unsupported dtype {dtype!r}: use one of {', '.join(_DTYPES)} or auto")


def _own_dtype(model: object) -> torch.dtype | None:
    """The dtype ``model`` was saved in, where it says (see :func:`resolve_dtype`)."""
    if isinstance(model, transformers.PreTrainedModel):
        return model.dtype
    if model is None or not isinstance(model, str | os.PathLike):
        return None
    config = pathlib.Path(model) / "config.json"
    if not config.is_file():
        return None
    with open(config, encoding="utf-8") as f:
        named = json.load(f)
    name = named.get("torch_dtype") or named.get("dtype")
    return getattr(torch, name, None) if isinstance(name, str) else None
