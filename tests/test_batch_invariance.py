"""Batch invariance: a query row's bits do not depend on what else a step holds.

Speculative decoding is exact only if the target's logits at a position are the same whether
the position is decoded alone, verified among drafts, batched with other sequences or computed
in a prefill chunk. These tests compare every such way bit for bit against one-token decodes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdec import LLM
from specdec.attention import AttentionMetadata, paged_attention
from specdec.kernels import cpu_ops
from specdec.models import linear as linear_module
from specdec.models.linear import (
    INVARIANT_TILE_ROWS,
    PackedLinear,
    can_prepack,
    onednn_keeps_rows,
)
from specdec.models.llama import LlamaForCausalLM
from specdec.runner import ModelRunner, QueryChunk
from tests.tiny import byte_tokenizer, tiny_model

needs_onednn = pytest.mark.skipif(not can_prepack(torch.bfloat16), reason="no oneDNN bf16")
BLOCK = 4


class Sequence:
    """Random bf16 queries, keys and values for every position of one sequence."""

    def __init__(self, length: int, first_block: int, heads: tuple[int, int, int]):
        num_heads, num_kv_heads, head_dim = heads
        self.q = torch.randn(length, num_heads, head_dim).to(torch.bfloat16)
        self.k = torch.randn(length, num_kv_heads, head_dim).to(torch.bfloat16)
        self.v = torch.randn(length, num_kv_heads, head_dim).to(torch.bfloat16)
        self.table = list(range(first_block, first_block + -(-length // BLOCK)))

    def slots(self, start: int, end: int) -> list[int]:
        return [self.table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]


def attend(parts: list[tuple[Sequence, int, int]], caches, invariant: bool = True):  # noqa: ANN001
    """Attention outputs of one step that computes positions ``start .. end - 1`` of each part."""
    q = torch.cat([s.q[a:b] for s, a, b in parts])
    k = torch.cat([s.k[a:b] for s, a, b in parts])
    v = torch.cat([s.v[a:b] for s, a, b in parts])
    slots = torch.tensor([x for s, a, b in parts for x in s.slots(a, b)])
    meta = AttentionMetadata.build(
        [b - a for _, a, b in parts], [b for _, _, b in parts], [s.table for s, _, _ in parts],
        slots, BLOCK, invariant,
    )  # fmt: skip
    out = paged_attention(q, k, v, *caches, meta, 0.125)
    return out.split([b - a for _, a, b in parts])


def torch_only(monkeypatch: pytest.MonkeyPatch, kernels: bool) -> None:
    """Without the fused CPU kernels, attention runs its oneDNN matmul path, which keeps rows'
    bits on AMX CPUs only (the engine does not rely on it elsewhere: ``can_batch_invariant``)."""
    if not kernels:
        if not onednn_keeps_rows():
            pytest.skip("oneDNN keeps bf16 rows' bits across row counts on AMX CPUs only")
        monkeypatch.setattr(cpu_ops, "extension_for", lambda t: None)


@needs_onednn
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 16), (4, 4, 32)])
def test_attention_rows_do_not_depend_on_the_batch(
    heads,  # noqa: ANN001
    kernels: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch_only(monkeypatch, kernels)
    torch.manual_seed(0)
    caches = [torch.zeros(128, BLOCK, heads[1], heads[2], dtype=torch.bfloat16) for _ in range(2)]
    seq = Sequence(300, 0, heads)  # more than one query tile (attention.QUERY_TILE)
    others = [Sequence(n, 80 + 12 * i, heads) for i, n in enumerate((9, 41, 23))]
    for other in others:  # their earlier positions are in the cache
        attend([(other, 0, len(other.q))], caches)
    attend([(seq, 0, 300)], caches)
    decoded = torch.cat([attend([(seq, p, p + 1)], caches)[0] for p in range(300)])
    ways = {
        "prefill": [(seq, 0, 300)],
        "prefill chunk": [(seq, 13, 250)],
        "verify 9 with others": [(others[0], 8, 9), (seq, 291, 300), (others[1], 30, 35)],
        "verify 17": [(seq, 53, 70)],
        "batched decodes": [(others[2], 22, 23), (seq, 269, 270), (others[1], 40, 41)],
        "chunk beside decodes": [(others[0], 8, 9), (seq, 20, 160), (others[2], 22, 23)],
    }
    for name, parts in ways.items():
        outs = attend(parts, caches)
        (_, start, end), out = next((p, o) for p, o in zip(parts, outs) if p[0] is seq)
        assert torch.equal(out, decoded[start:end]), name


@pytest.mark.skipif(not onednn_keeps_rows(), reason="oneDNN keeps bf16 rows' bits on AMX only")
def test_packed_linear_rows_do_not_depend_on_the_row_count() -> None:
    torch.manual_seed(0)
    linear = PackedLinear(nn.Linear(576, 960).to(torch.bfloat16), max_rows=INVARIANT_TILE_ROWS)
    x = torch.randn(100, 576).to(torch.bfloat16)
    with torch.inference_mode():
        one_by_one = torch.cat([linear(x[i : i + 1]) for i in range(100)])
        for rows in (2, 9, 32, 33, 64, 100):
            assert torch.equal(linear(x[:rows]), one_by_one[:rows]), rows


@needs_onednn
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch"])
def test_model_logits_do_not_depend_on_how_positions_are_batched(
    kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch_only(monkeypatch, kernels)
    _check_model_logits(torch.bfloat16, None)


@pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q/k/v biases; per-head q/k norms
def test_model_logits_on_the_cpu_kernels_do_not_depend_on_how_positions_are_batched(
    dtype: torch.dtype, arch: str
) -> None:
    """On the C++ kernels, float32 (linears packed in lanes) as well as bfloat16."""
    _check_model_logits(dtype, True, arch)


def _check_model_logits(
    dtype: torch.dtype, batch_invariant: bool | None, arch: str = "qwen2"
) -> None:
    torch.manual_seed(0)
    hf = tiny_model(arch)
    state = {k: v.to(dtype) for k, v in hf.state_dict().items()}
    model = LlamaForCausalLM.from_hf(hf.config, state, 256, batch_invariant=batch_invariant)
    assert model.batch_invariant
    runner = ModelRunner(model, 64, BLOCK, dtype)
    prompt = torch.randint(0, 256, (70,)).tolist()
    other = torch.randint(0, 256, (30,)).tolist()
    table, other_table = list(range(18)), list(range(20, 28))

    def logits(*chunks: QueryChunk) -> torch.Tensor:
        return runner.forward(list(chunks))[0]

    def ours(start: int, end: int, rows: int) -> QueryChunk:
        return QueryChunk(prompt[start:end], start, table, rows)

    logits(QueryChunk(other, 0, other_table, 0))
    one_by_one = torch.cat([logits(ours(p, p + 1, 1)) for p in range(70)])
    assert torch.equal(logits(ours(0, 70, 70)), one_by_one)  # a whole prefill
    assert torch.equal(logits(ours(30, 70, 40)), one_by_one[30:])  # a later chunk
    beside = logits(QueryChunk(other[29:], 29, other_table, 1), ours(61, 70, 9))
    assert torch.equal(beside[1:], one_by_one[61:])  # a verification beside a decode


def test_batch_invariance_needs_the_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_ops, "enabled", lambda: False)
    monkeypatch.setattr(linear_module, "can_prepack", lambda dtype: False)
    with pytest.raises(ValueError, match="batch-invariant kernels need the CPU kernels"):
        LLM(tiny_model("llama"), tokenizer=byte_tokenizer(), batch_invariant=True)
