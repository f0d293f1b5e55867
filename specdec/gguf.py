"""A GGUF file's quantized linear weights, kept quantized.

GGUF's Q4_1 block (llama.cpp ``block_q4_1``) holds 32 weights of one row as a float16 scale
``d``, a float16 minimum ``m`` and 16 bytes of 4-bit codes: byte ``j`` has weight ``j`` in its
low nibble and weight ``j + 16`` in its high one, and ``w = d * q + m``. Q8_0 (``block_q8_0``)
holds a float16 scale and 32 int8 codes, ``w = d * q``. Those are exactly the int4 and int8
weights of :mod:`specdec.kernels.cpu_quant`, so they are read into :class:`QuantWeight`s code
for code. Tensors of any other GGUF type are not returned here: the loader's dequantized float
weights serve them, and :func:`specdec.models.quant.quantize_linears` quantizes those.

llama.cpp's converter permutes the rows of a Llama model's q and k projections (it interleaves
each head's two RoPE halves); they are permuted back here as transformers' GGUF loader does,
rows with their scales, so the result matches the float weights the loader produces.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import tempfile

import numpy as np
import safetensors.torch
import torch

from specdec.kernels.cpu_quant import GROUP, QuantWeight

logger = logging.getLogger(__name__)
CACHE_FORMAT = 1  # bump when what read_quantized returns changes

Q4_1, Q8_0 = "Q4_1", "Q8_0"  # the GGML types read here
_PROJECTIONS = {
    "attn_q": ("self_attn.qkv_proj", 0),  # (our fused module, its place in the concatenation)
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}


def read_quantized(
    path: str | pathlib.Path, num_heads: int, num_kv_heads: int
) -> dict[str, QuantWeight]:
    """The Q4_1 and Q8_0 linear weights of the GGUF file at ``path``, by our module names.

    Keys are the native model's linears (``layers.3.self_attn.qkv_proj``, ``lm_head``); a fused
    projection is returned only when all its parts are of one supported type. The output layer
    is ``output.weight``, or the tied ``token_embd.weight`` when the file has no output tensor.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    architecture = _architecture(reader)
    tensors = {t.name: t for t in reader.tensors}
    parts: dict[str, dict[int, QuantWeight]] = {}
    for name, tensor in tensors.items():
        pieces = name.split(".")
        if len(pieces) != 4 or pieces[0] != "blk" or pieces[2] not in _PROJECTIONS:
            continue
        weight = _read(tensor)
        if weight is None:
            continue
        if architecture == "llama" and pieces[2] in ("attn_q", "attn_k"):
            heads = num_heads if pieces[2] == "attn_q" else num_kv_heads
            weight = weight.take_rows(_unpermute_rows(weight.shape[0], heads))
        module, index = _PROJECTIONS[pieces[2]]
        parts.setdefault(f"layers.{pieces[1]}.{module}", {})[index] = weight
    weights = {name: _concat(p) for name, p in parts.items() if _complete(name, p)}
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))
    head_weight = None if head is None else _read(head)
    if head_weight is not None:
        weights["lm_head"] = head_weight
    return weights


def read_quantized_cached(
    path: str | pathlib.Path, num_heads: int, num_kv_heads: int, cache: pathlib.Path
) -> dict[str, QuantWeight]:
    """:func:`read_quantized`, kept in a safetensors file under ``cache`` after the first read.

    gguf's reader parses every metadata field (the vocabulary's 49,152 strings in the default
    model's file) and copies the tensors through numpy memmaps: 4-5 s of every
    ``LLM(quantization=...)`` and ``quantized_self`` start, against about 1 s for a float one.
    The cache file is named by the GGUF file's resolved path, size and modification time and the
    head counts, so an edited or replaced file is read again; a cache that cannot be read or
    written is read around, with a warning, never trusted half-written (it is renamed into place).
    """
    path = pathlib.Path(path)
    stat = path.stat()
    identity = f"{CACHE_FORMAT}\n{path.resolve()}\n{stat.st_size}\n{stat.st_mtime_ns}"
    identity += f"\n{num_heads}\n{num_kv_heads}"
    cached = cache / f"{hashlib.sha256(identity.encode()).hexdigest()[:24]}.safetensors"
    if cached.is_file():
        try:
            return _from_tensors(safetensors.torch.load_file(cached))
        except Exception as error:  # a damaged file: read the GGUF again and replace it
            logger.warning("specdec: ignoring the unreadable cache %s (%s)", cached, error)
    weights = read_quantized(path, num_heads, num_kv_heads)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=f".{cached.name}.", dir=cache)
        os.close(handle)
        try:
            safetensors.torch.save_file(_to_tensors(weights), staging)
            os.replace(staging, cached)
        finally:
            if os.path.exists(staging):
                os.remove(staging)
    except OSError as error:
        logger.warning("specdec: could not cache %s's quantized weights (%s)", path, error)
    return weights


def _to_tensors(weights: dict[str, QuantWeight]) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, w in weights.items():
        tensors[f"{name}.codes"], tensors[f"{name}.scales"] = w.codes, w.scales
        if w.mins is not None:
            tensors[f"{name}.mins"] = w.mins
    return tensors


def _from_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, QuantWeight]:
    names = [key.removesuffix(".codes") for key in tensors if key.endswith(".codes")]
    return {
        n: QuantWeight(tensors[f"{n}.codes"], tensors[f"{n}.scales"], tensors.get(f"{n}.mins"))
        for n in names
    }


def _architecture(reader) -> str:  # noqa: ANN001 - a gguf.GGUFReader
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def _read(tensor) -> QuantWeight | None:  # noqa: ANN001 - a gguf ReaderTensor
    """A Q4_1 or Q8_0 tensor's weight [rows, in]; None for any other type."""
    kind = tensor.tensor_type.name
    if kind not in (Q4_1, Q8_0):
        return None
    width = int(tensor.shape[0])  # GGUF lists dimensions innermost first
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(
        -1, width // GROUP, tensor.data.shape[-1] // (width // GROUP)
    )
    raw = torch.from_numpy(blocks.copy())  # [rows, groups, bytes per block]
    scales = raw[..., :2].contiguous().view(torch.float16).squeeze(-1)  # [rows, groups]
    if kind == Q8_0:
        codes = raw[..., 2:].contiguous().view(torch.int8)  # [rows, groups, 32]
        return QuantWeight(codes.reshape(raw.shape[0], width), scales)
    mins = raw[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
    nibbles = raw[..., 4:]  # [rows, groups, 16]: weights j (low) and j + 16 (high)
    codes = torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1)  # [rows, groups, 32]
    return QuantWeight(codes.reshape(raw.shape[0], width), scales, mins)


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (transformers'
    ``_reverse_permute_weights``, applied to row indices)."""
    index = torch.arange(rows).reshape(heads, rows // heads // 2, 2)
    return index.transpose(1, 2).reshape(rows)


def _complete(name: str, parts: dict[int, QuantWeight]) -> bool:
    needed = 3 if name.endswith("qkv_proj") else 2 if name.endswith("gate_up_proj") else 1
    return len(parts) == needed and len({p.bits for p in parts.values()}) == 1


def _concat(parts: dict[int, QuantWeight]) -> QuantWeight:
    ordered = [parts[i] for i in sorted(parts)]
    mins = None if ordered[0].mins is None else torch.cat([p.mins for p in ordered])  # type: ignore[misc]
    return QuantWeight(
        torch.cat([p.codes for p in ordered]), torch.cat([p.scales for p in ordered]), mins
    )
