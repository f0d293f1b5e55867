"""Default sampling parameters from the model's generation config, as vLLM takes them.

A model's ``generation_config.json`` often holds its creator's recommended sampling settings
(Qwen's chat models: temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.05). vLLM
(``--generation-config auto``, its default) makes them the defaults of every request that does
not set them, and this module does the same for ``LLM.generate``, ``LLM.chat``,
``LLM.stream`` and the server: the fields read are ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``), each where the
config sets it (``GenerationConfig.to_diff_dict``, as vLLM reads it: what differs from
transformers' defaults, which leave every sampling field unset), and ``do_sample`` is not read
(as in vLLM). ``"vllm"`` ignores the file (the neutral defaults);
a directory path reads that directory's ``generation_config.json`` instead; an override dict
(vLLM's ``override_generation_config``) is laid over whichever was read.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import transformers

from specdec.config import SamplingParams

# generation-config fields that become default sampling parameters (max_new_tokens as max_tokens)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def sampling_defaults(
    source: str | os.PathLike,
    model_config: transformers.GenerationConfig | None,
    override: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The default sampling parameters, as ``SamplingParams`` keyword arguments (only those that
    differ from the neutral ones): from ``model_config`` (``source="auto"``), none (``"vllm"``),
    or a directory's ``generation_config.json``, with ``override`` laid over them. ValueError
    for an unknown source, an override field that is not a sampling field, or values that
    ``SamplingParams`` refuses, each said with where it came from."""
    if source == "vllm":
        config: dict[str, Any] = {}
    elif source == "auto":
        config = model_config.to_diff_dict() if model_config is not None else {}
    else:
        config = _read_directory(pathlib.Path(source))
    unknown = sorted(set(override or {}) - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(
            f"override_generation_config: {', '.join(map(repr, unknown))} not sampling fields; "
            f"it takes {', '.join(SAMPLING_FIELDS)}"
        )
    config.update(override or {})
    defaults = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the generation config's sampling defaults {defaults}: {e}") from e
    return defaults


def _read_directory(path: pathlib.Path) -> dict[str, Any]:
    """The fields of ``path/generation_config.json`` that differ from transformers' defaults."""
    if not (path / "generation_config.json").is_file():
        raise ValueError(
            f"generation_config must be 'auto' (the model's own), 'vllm' (none) or a directory "
            f"holding generation_config.json; {str(path)!r} is none of them"
        )
    config = transformers.GenerationConfig.from_pretrained(path, local_files_only=True)
    return dict(config.to_diff_dict())
