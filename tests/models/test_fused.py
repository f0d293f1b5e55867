"""The C++ decoder stack (models/fused.py): the Python layers' bits, and only where it applies."""

from __future__ import annotations

import pytest
import torch

from specdec.kernels import cpu_ops
from specdec.models import fused
from specdec.models.fused import FusedStack
from specdec.models.linear import can_prepack
from specdec.models.llama import LlamaForCausalLM
from specdec.models.lora import install_deltas, remove_deltas
from specdec.runner import ModelRunner, QueryChunk
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
BLOCK = 4
CONFIGS = {  # (arch, dtype, quantization): every kind of linear the stack takes
    "float32": ("llama", torch.float32, None),
    "bf16-invariant": ("qwen2", torch.bfloat16, None),  # q/k/v biases
    "int4": ("llama", torch.float32, "int4"),
    "w4a8-bf16": ("qwen2", torch.bfloat16, "w4a8"),
    "w8a8": ("mistral", torch.float32, "w8a8"),
    "qwen3": ("qwen3", torch.float32, None),  # per-head query and key norms
    "qwen3-bf16": ("qwen3", torch.bfloat16, None),
}


def build(arch: str, dtype: torch.dtype, quantization: str | None, **options) -> LlamaForCausalLM:
    if dtype == torch.bfloat16:  # not invariant by default on scalar kernels: always ask for it
        options.setdefault("batch_invariant", True)
    hf = tiny_model(arch, hidden_size=64)
    state = {k: v.to(dtype) for k, v in hf.state_dict().items()}
    return LlamaForCausalLM.from_hf(hf.config, state, 256, quantization=quantization, **options)


def steps(
    runner: ModelRunner, keep_layers: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prompts for three sequences, then steps of decodes and of verifications mixed (padded
    to the widest query) and alike (dense); each step's logits and final hidden states. With
    ``keep_layers``, every step also keeps its first token's states after every layer."""
    torch.manual_seed(0)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (13, 30, 7)]
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(3)]
    runner.forward([QueryChunk(p, 0, t, 1) for p, t in zip(prompts, tables)])
    lengths = [len(p) for p in prompts]
    out = []
    for queries in ([1, 1, 1], [5, 1, 3], [4, 4, 4], [1], [18, 2, 1]):
        chunks = []
        for i, q in enumerate(queries):
            tokens = torch.randint(0, 256, (q,)).tolist()
            chunks.append(QueryChunk(tokens, lengths[i], tables[i], q))
        logits, hidden, _, layers = runner.forward(chunks, [0] if keep_layers else None)
        assert (layers is not None) == keep_layers
        out.append((logits, hidden))
        lengths = [n + 1 for n in lengths]  # the first query of each is kept
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stack_gives_the_python_layers_bits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes, verifications of one depth (a dense group) and of mixed depths (padded), a lone
    sequence: the stack's logits and hidden states equal the Python layers' bit for bit, also
    where a step keeps every layer's states (a request's ``return_hidden_states``)."""
    arch, dtype, quantization = CONFIGS[name]
    model = build(arch, dtype, quantization)
    stack = model.fused
    assert isinstance(stack, FusedStack)
    calls = []
    run = stack.forward
    monkeypatch.setattr(stack, "forward", lambda *a: calls.append(1) or run(*a))
    fast = steps(ModelRunner(model, 64, BLOCK, dtype))
    assert len(calls) == 4  # every step but the one with an 18-token query (a group of its own)
    kept = steps(ModelRunner(model, 64, BLOCK, dtype), keep_layers=True)
    assert len(calls) == 4  # those steps ran the Python layers
    model.fused = None
    slow = steps(ModelRunner(model, 64, BLOCK, dtype))
    for other in (slow, kept):
        for (fast_logits, fast_hidden), (logits, hidden) in zip(fast, other):
            assert torch.equal(fast_logits, logits) and torch.equal(fast_hidden, hidden)


def test_stack_follows_the_caches_it_is_given() -> None:
    """A second runner hands the layers other K/V tensors: the stack reads those (the first
    runner's are wiped, so a stack still reading them would see zero keys)."""
    model = build("llama", torch.float32, None)
    runner = ModelRunner(model, 64, BLOCK, torch.float32)
    first = steps(runner)
    for cache in (*runner.k_caches, *runner.v_caches):
        cache.zero_()
    second = steps(ModelRunner(model, 64, BLOCK, torch.float32))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, second))
    assert model.fused is not None and model.fused.caches[0] is model.layers[0].self_attn.k_cache


def test_stack_is_left_out_where_a_linear_has_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    if can_prepack(torch.bfloat16):  # bf16 without invariance: oneDNN's packed linears
        assert build("llama", torch.bfloat16, None, batch_invariant=False).fused is None
    monkeypatch.setenv(fused.FUSED_STACK_ENV, "0")
    assert build("llama", torch.float32, None).fused is None


def lora_steps(runner: ModelRunner, keys: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """As :func:`steps`, the sequences running through LoRA adapters ``keys`` (0: none)."""
    torch.manual_seed(0)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (13, 30, 7)]
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(3)]
    runner.forward([QueryChunk(p, 0, t, 1, k) for p, t, k in zip(prompts, tables, keys)])
    lengths, out = [len(p) for p in prompts], []
    for queries in ([1, 1, 1], [5, 1, 3], [4, 4, 4], [1]):
        chunks = [
            QueryChunk(torch.randint(0, 256, (q,)).tolist(), lengths[i], tables[i], q, keys[i])
            for i, q in enumerate(queries)
        ]
        logits, hidden, _, _ = runner.forward(chunks)
        out.append((logits, hidden))
        lengths = [n + 1 for n in lengths]
    return out


@pytest.mark.parametrize("name", ["float32", "bf16-invariant", "int4", "w4a8-bf16", "qwen3"])
@pytest.mark.parametrize("keys", [[1, 0, 2], [1, 1, 1]])
def test_stack_runs_lora_deltas_with_the_python_layers_bits(
    name: str, keys: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adapters on some rows, or one on every row: the stack's logits equal the Python
    layers' bit for bit, and an adapter let go leaves the stack."""
    arch, dtype, quantization = CONFIGS[name]
    model = build(arch, dtype, quantization)
    cfg = model.config
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    shapes = {"self_attn.qkv_proj": (h, q + 2 * kv), "self_attn.o_proj": (q, h),
              "mlp.gate_up_proj": (h, 2 * cfg.intermediate_size),
              "mlp.down_proj": (cfg.intermediate_size, h)}  # fmt: skip
    torch.manual_seed(1)
    for key, skip in ((1, "self_attn.o_proj"), (2, "mlp.down_proj")):  # each leaves one alone
        weights = {
            f"layers.{i}.{path}": (torch.randn(4, n_in).to(dtype), torch.randn(n_out, 4).to(dtype))
            for i in range(cfg.num_layers)
            for path, (n_in, n_out) in shapes.items()
            if path != skip
        }
        install_deltas(model, key, weights)
    stack = model.fused
    assert isinstance(stack, FusedStack) and set(stack.adapters) == {1, 2}
    calls = []
    run = stack.forward
    monkeypatch.setattr(stack, "forward", lambda *a: calls.append(1) or run(*a))
    fast = lora_steps(ModelRunner(model, 64, BLOCK, dtype), keys)
    assert len(calls) == 4
    model.fused = None
    slow = lora_steps(ModelRunner(model, 64, BLOCK, dtype), keys)
    for (fast_logits, fast_hidden), (logits, hidden) in zip(fast, slow):
        assert torch.equal(fast_logits, logits) and torch.equal(fast_hidden, hidden)
    base = lora_steps(ModelRunner(model, 64, BLOCK, dtype), [0, 0, 0])
    assert not torch.equal(base[0][0], slow[0][0])  # the adapters change the logits
    model.fused = stack
    remove_deltas(model, 1)
    assert set(stack.adapters) == {2} and stack.stack is None
