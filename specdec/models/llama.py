"""The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM) on a paged KV cache.

One implementation with per-architecture switches read from the Hugging Face config: Qwen2 adds
a bias to the q/k/v projections, Qwen3 an RMS norm on each query and key head; embeddings are
tied or not; grouped-query attention; RoPE with
the config's theta and scaling (computed by transformers' own RoPE init functions, so every
variant it knows matches). q/k/v and gate/up projections are fused into one matmul each, which
matters when decode is bound by per-matmul overhead. The model never allocates KV: the runner
hands each attention layer views of its cache tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specdec.attention import AttentionMetadata, paged_attention
from specdec.kernels import cpu_ops
from specdec.models.fused import FusedStack
from specdec.models.fused import enabled as fused_enabled
from specdec.models.hugepages import move_to_huge_pages
from specdec.models.linear import (
    batch_invariant_by_default,
    can_batch_invariant,
    prepack_linears,
    use_row_kernels,
)
from specdec.models.lora import LoRARows
from specdec.models.quant import QuantLinear, QuantWeight, quantize_linears

FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}  # config.model_type


@dataclass(slots=True)
class ModelArchConfig:
    """The shape of a Llama-family model, read from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool  # Qwen2 has biases on q, k and v
    qk_norm: bool  # Qwen3 RMS-norms each query and key head before RoPE
    tie_word_embeddings: bool
    max_position_embeddings: int

    @staticmethod
    def from_hf(config) -> ModelArchConfig:  # noqa: ANN001 - any transformers config
        heads = config.num_attention_heads
        return ModelArchConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=config.model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``norm(x)``; with ``residual``, first ``residual += x`` in place and norm the sum."""
        if residual is None:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        return cpu_ops.add_rms_norm_(residual, x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, built once from the config's RoPE parameters."""

    def __init__(self, hf_config, max_positions: int):  # noqa: ANN001
        super().__init__()
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "dynamic":
            raise ValueError(
                "dynamic RoPE scaling is not supported (its tables change with length)"
            )
        with torch.device("cpu"):  # real tables even while the model is built on "meta"
            cos, sin = self._tables(hf_config, rope_type, max_positions)
        self.register_buffer("cos", cos, persistent=False)  # [P, D]
        self.register_buffer("sin", sin, persistent=False)  # [P, D]

    @staticmethod
    def _tables(
        hf_config,
        rope_type: str,  # noqa: ANN001
        max_positions: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        params = getattr(hf_config, "rope_parameters", None) or {}
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            dim = ModelArchConfig.from_hf(hf_config).head_dim
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq.float()  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        return emb.cos() * scaling, emb.sin() * scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos and sin at ``positions``, looked up once per forward and shared by all layers."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)  # [N, D] each


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [N, D] each, in the model's dtype


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        # Qwen3: each head's query and key RMS-normed over its dims (HF's q_norm, k_norm)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.k_cache = torch.empty(0)  # views of the runner's KV tensors, set by the runner
        self.v_cache = torch.empty(0)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        rope: Rope,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # [N, (Hq + 2 Hkv) D]
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_heads(qkv, n, self.q_norm, self.k_norm)
        # Rotate queries and keys in place, in one pass, then split by head.
        cpu_ops.rope_(qkv, *rope, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.view(n, -1, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1
        )
        out = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj.forward(out.reshape(n, self.q_size))

    def _norm_heads(self, qkv: torch.Tensor, n: int, q_norm: RMSNorm, k_norm: RMSNorm) -> None:
        """Qwen3's query and key norms, in place: every head's ``head_dim`` values RMS-normed,
        row by row (so a row's result does not depend on the step's other rows)."""
        d, q_end, k_end = self.head_dim, self.q_size, self.q_size + self.kv_size
        q = qkv[:, :q_end].reshape(n * self.num_heads, d)  # [N Hq, D], a copy
        k = qkv[:, q_end:k_end].reshape(n * self.num_kv_heads, d)  # [N Hkv, D]
        qkv[:, :q_end] = q_norm.forward(q).view(n, self.q_size)
        qkv[:, q_end:k_end] = k_norm.forward(k).view(n, self.kv_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(cpu_ops.silu_mul(self.gate_up_proj.forward(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]: the last layer's output (the embeddings for the first)
        residual: torch.Tensor | None,  # [N, hidden]: the residual stream before x is added
        rope: Rope,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's output and the residual stream it was computed from. The residual add is
        fused into the RMSNorm after it, as vLLM does (one call where it would make two; the
        stream is updated in place). Direct ``.forward`` calls: ``nn.Module.__call__`` costs
        more than a small decode op here."""
        if residual is None:
            residual = x
            h = self.input_layernorm.forward(x)
        else:
            h = self.input_layernorm.forward(x, residual)
        h = self.self_attn.forward(h, rope, meta)
        h = self.post_attention_layernorm.forward(h, residual)
        return self.mlp.forward(h), residual


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder: ``forward`` gives hidden states, ``compute_logits`` the logits."""

    def __init__(self, hf_config, max_positions: int):  # noqa: ANN001
        super().__init__()
        self.config = cfg = ModelArchConfig.from_hf(hf_config)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(hf_config, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.batch_invariant = False  # set by from_hf; the runner's attention follows it
        self.fused: FusedStack | None = None  # set by from_hf where the kernels take every layer
        self.lora: LoRARows | None = None  # the adapters' rows, once LoRA is attached (lora.py)

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]  # type: ignore[misc]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [N, hidden]
        x = self.embed_tokens(input_ids)  # [N, hidden], a fresh tensor: the residual stream
        rope = self.rope(positions, x.dtype)
        lora = self.lora.rows if self.lora is not None else []  # this step's adapters' rows
        if self.fused is not None and self.fused.eligible(x, meta, lora):
            return self.fused.forward(x, rope, meta, lora)  # the same ops in one C++ call
        residual = None
        for layer in self.layers:
            x, residual = layer.forward(x, residual, rope, meta)
        return self.norm.forward(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, hidden] -> [M, V]
        return self.lm_head(hidden)

    @classmethod
    def from_hf(
        cls,
        hf_config,
        state_dict: dict[str, torch.Tensor],  # noqa: ANN001
        max_positions: int,
        batch_invariant: bool | None = None,
        quantization: str | None = None,
        prequantized: dict[str, QuantWeight] | None = None,
        huge_pages: bool = True,
        device: torch.device | str = "cpu",
    ) -> LlamaForCausalLM:
        """Build the model around weights named as in transformers, without a random init.

        ``batch_invariant``: every row's result independent of what else a step holds (see
        :mod:`specdec.attention`), so that speculative decoding gives exactly the tokens of plain
        decoding. ``None`` turns it on where the CPU kernels run at vector speed, on a CPU with
        AVX-512 or AVX2 (see :func:`~specdec.models.linear.batch_invariant_by_default`), in
        float32 and bfloat16 alike.

        ``quantization`` (``"int8"``, ``"int4"``, ``"w8a8"``, ``"w4a8"`` or ``None``): quantized
        linears (see :mod:`specdec.models.quant`), ``prequantized`` the weights that arrived quantized (a GGUF
        file's), by module name. Quantized linears are row-invariant in every dtype.

        ``huge_pages``: copy the weights into a huge-page arena (see
        :mod:`specdec.models.hugepages`); ``False`` keeps them in the tensors given, as
        ``specdec.wrap`` does to run on a transformers model's own storage.

        ``device``: where the weights live. On CUDA the model runs torch's own ops (cuBLAS
        linears, SDPA for prompts, the Triton paged-attention kernel for decodes); quantized
        linears, the CPU kernels and batch invariance are CPU features, refused there.
        """
        device = torch.device(device)
        if device.type == "cuda":
            _check_cuda_options(batch_invariant, quantization)
        with torch.device("meta"):
            model = cls(hf_config, max_positions)
        model.to_empty(device=device)
        model.rope = RotaryEmbedding(hf_config, max_positions).to(device)  # emptied above
        if model.config.tie_word_embeddings:  # to_empty gives each module a tensor of its own
            model.lm_head.weight = model.embed_tokens.weight
        model.load_hf_state_dict(state_dict)
        if device.type == "cuda":
            model.batch_invariant = False
            return model.eval().requires_grad_(False)
        if quantization is not None:
            quantize_linears(model, quantization, prequantized)
        supported = can_batch_invariant(model.embed_tokens.weight.dtype)
        if batch_invariant and not supported:
            raise ValueError(
                "batch-invariant kernels need the CPU kernels (see specdec.kernels.cpu_ops; "
                "bfloat16 can use oneDNN's on AMX CPUs); pass batch_invariant=False"
            )
        if batch_invariant is None:
            batch_invariant = batch_invariant_by_default(model.embed_tokens.weight.dtype)
        model.batch_invariant = batch_invariant
        # float32 and invariant bf16 linears on the C++ kernels, packed; the other bf16
        # linears on oneDNN-packed weights (see models/linear.py)
        use_row_kernels(model, invariant=model.batch_invariant)
        prepack_linears(model, invariant=model.batch_invariant)
        if huge_pages:
            move_to_huge_pages(model)  # weights streamed from 2 MB pages (see models/hugepages.py)
        model.eval().requires_grad_(False)
        model.fused = FusedStack.build(model) if fused_enabled() else None  # models/fused.py
        return model

    def weight_bytes_per_step(self) -> int:
        """Bytes of weights a decode step reads: every matrix once, one row of the embedding."""
        cfg, elem = self.config, self.embed_tokens.weight.element_size()
        quantized = [m.weight_nbytes for m in self.modules() if isinstance(m, QuantLinear)]
        if quantized:
            return sum(quantized) + elem * ((2 * cfg.num_layers + 2) * cfg.hidden_size)
        attn = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        attn += cfg.num_heads * cfg.head_dim * cfg.hidden_size
        mlp = 3 * cfg.hidden_size * cfg.intermediate_size
        norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
        head = cfg.vocab_size * cfg.hidden_size
        return elem * (cfg.num_layers * (attn + mlp) + norms + head + cfg.hidden_size)

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Take weights named as in transformers, fusing q/k/v and gate/up on the way."""
        own = dict(self.named_parameters())  # a tied lm_head is listed once, as embed_tokens
        for name, tensor in _fused_weights(state_dict, self.config.num_layers):
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name not in own:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(own[name].shape)}"
                )
            param = own.pop(name)
            param.data = tensor.to(param.device).contiguous()  # no copy where devices agree
        if own:
            raise ValueError(f"checkpoint is missing weights: {sorted(own)[:5]}")


def _check_cuda_options(batch_invariant: bool | None, quantization: str | None) -> None:
    """Refuse what runs only on the CPU, with the reason."""
    if batch_invariant:
        raise ValueError(
            "batch_invariant=True is a CPU mode: on CUDA, cuBLAS chooses its kernels by the row "
            "count, so a verification step need not round as a decode step does, and bfloat16 "
            "speculation on CUDA is not bit-exact (float32 greedy is); pass batch_invariant=None "
            "or False, or run on the CPU"
        )
    if quantization is not None:
        raise ValueError(
            f"quantization={quantization!r} runs on the CPU kernels only; on CUDA load the model "
            "in float32, bfloat16 or float16"
        )


def _fused_weights(state_dict: dict[str, torch.Tensor], num_layers: int):  # noqa: ANN202
    """Yield (our name, tensor): transformers names with q/k/v and gate/up concatenated."""
    sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
    for i in range(num_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            parts = [sd.pop(f"{p}self_attn.{n}_proj.{kind}", None) for n in "qkv"]
            if all(t is not None for t in parts):
                yield f"{p}self_attn.qkv_proj.{kind}", concat_rows(parts)  # type: ignore[arg-type]
        gate, up = sd.pop(f"{p}mlp.gate_proj.weight"), sd.pop(f"{p}mlp.up_proj.weight")
        yield f"{p}mlp.gate_up_proj.weight", concat_rows([gate, up])
    yield from sd.items()


def concat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` along rows; a view, not a copy, when the parts already lie back to
    back in one storage (as :func:`specdec.wrap.fuse_projections` leaves a model's q/k/v and
    gate/up weights)."""
    if not rows_adjacent(parts):
        return torch.cat(parts, dim=0)
    first, rows = parts[0], sum(part.shape[0] for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def rows_adjacent(parts: list[torch.Tensor]) -> bool:
    """Whether contiguous ``parts`` lie back to back, in order, in one storage."""
    first, end = parts[0], parts[0].data_ptr()
    for part in parts:
        same = part.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not (same and part.is_contiguous() and part.data_ptr() == end):
            return False
        end += part.numel() * part.element_size()
    return True
