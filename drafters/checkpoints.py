"""Training checkpoints of heads (drafters/train_heads.py): resumable, in safetensors.

A checkpoint is a directory ``step-NNNNNN`` holding ``heads.safetensors`` (the module's state),
``optimizer.safetensors`` (AdamW's moments and step count per parameter, keyed by the
parameter's index in the optimizer) and ``state.json`` (the step), written last, so that a
directory without it is an interrupted write and is ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn


def save_checkpoint(
    directory: Path, step: int, module: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Heads and AdamW moments as safetensors, the step in ``state.json``; the two latest kept."""
    path = directory / f"step-{step:06d}"
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {n: t.detach().contiguous() for n, t in module.state_dict().items()},
        str(path / "heads.safetensors"),
    )
    moments = {}
    for i, param in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        state = optimizer.state.get(param, {})
        for name in ("exp_avg", "exp_avg_sq"):
            if name in state:
                moments[f"{i}.{name}"] = state[name].contiguous()
        if "step" in state:
            moments[f"{i}.step"] = torch.as_tensor(state["step"], dtype=torch.float64).reshape(1)
    save_file(moments, str(path / "optimizer.safetensors"))
    (path / "state.json").write_text(json.dumps({"step": step}) + "\n", encoding="utf-8")
    for old in sorted(directory.glob("step-*"))[:-2]:
        for file in old.iterdir():
            file.unlink()
        old.rmdir()


def resume(directory: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the latest checkpoint under ``directory`` into ``module`` and ``optimizer``; return
    its step (0 when there is none)."""
    done = sorted(p for p in directory.glob("step-*") if (p / "state.json").is_file())
    if not done:
        return 0
    path = done[-1]
    module.load_state_dict(load_file(str(path / "heads.safetensors")))
    moments = load_file(str(path / "optimizer.safetensors"))
    for i, param in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        if f"{i}.exp_avg" in moments:
            optimizer.state[param] = {
                "step": moments[f"{i}.step"].reshape(()).float(),
                "exp_avg": moments[f"{i}.exp_avg"],
                "exp_avg_sq": moments[f"{i}.exp_avg_sq"],
            }
    return int(json.loads((path / "state.json").read_text(encoding="utf-8"))["step"])
