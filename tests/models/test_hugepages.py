"""specdec.models.hugepages: weights on 2 MB pages, with nothing else changed; the KV pool."""

import pytest
import torch

from specdec.kernels import cpu_ops
from specdec.models import hugepages
from specdec.models.hugepages import HUGE_PAGE, huge_page_buffer, move_to_huge_pages
from specdec.models.llama import LlamaForCausalLM
from specdec.runner import ModelRunner
from tests.tiny import tiny_model

needs_huge_pages = pytest.mark.skipif(
    not hugepages.huge_pages_available(), reason="no madvise(MADV_HUGEPAGE) here"
)


@needs_huge_pages
def test_a_buffer_starts_on_a_huge_page_and_is_zeroed() -> None:
    buf = huge_page_buffer(3 * HUGE_PAGE + 5)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 5
    assert buf.data_ptr() % HUGE_PAGE == 0 and not buf.any()
    buf[-1] = 7  # writable to its last byte
    assert int(buf.sum()) == 7


@needs_huge_pages
@pytest.mark.parametrize("kernels", [True, False], ids=["packed", "plain"])
def test_moved_weights_keep_values_ties_and_logits(
    kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed for the CPU kernels (float32 in lanes), or plain ``nn.Linear``s whose output layer
    is the embedding's tensor, a tie that must survive the move."""
    if not kernels:
        monkeypatch.setattr(cpu_ops, "enabled", lambda: False)
    hf = tiny_model("llama")  # tied embeddings
    model = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), 64)  # moves nothing: all tiny
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    hidden = torch.randn(3, hf.config.hidden_size)
    with torch.inference_mode():
        expected = model.compute_logits(hidden)
    moved = move_to_huge_pages(model, min_bytes=0)
    params = list(model.parameters())
    assert moved >= sum(p.numel() * p.element_size() for p in params)
    starts = sorted(p.data_ptr() for p in params)
    assert starts[0] % HUGE_PAGE == 0 and starts[-1] - starts[0] < moved  # one arena
    assert all(p.data_ptr() % hugepages.ALIGN == 0 for p in params)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    if not kernels:
        assert model.lm_head.weight is model.embed_tokens.weight  # still one tensor
    with torch.inference_mode():
        assert torch.equal(model.compute_logits(hidden), expected)


def test_switched_off_nothing_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hugepages.ENV, "0")
    hf = tiny_model("llama")
    model = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), 64)
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert move_to_huge_pages(model, min_bytes=0) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    with pytest.raises(RuntimeError, match="huge pages are not available"):
        huge_page_buffer(HUGE_PAGE)


def test_kv_pool_is_zeroed_and_one_tensor_per_layer() -> None:
    hf = tiny_model("llama")
    model = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), 64)
    runner = ModelRunner(model, num_blocks=5, block_size=4, dtype=torch.float32)
    caches = runner.k_caches + runner.v_caches
    assert len(caches) == 2 * hf.config.num_hidden_layers
    assert len({c.data_ptr() for c in caches}) == len(caches)  # no two layers share memory
    for cache in caches:
        assert cache.shape == (5, 4, model.config.num_kv_heads, model.config.head_dim)
        assert cache.is_contiguous() and not cache.any()
    caches[0].fill_(1.0)
    assert not caches[1].any() and not runner.v_caches[0].any()


@needs_huge_pages
def test_quantized_weights_move_with_the_rest() -> None:
    """A quantized linear's codes, scales and minimums are frozen parameters, so the arena takes
    them (as buffers they stayed on 4 KB pages: int4 decode ran 1.08x slower there)."""
    from specdec.models.quant import QuantLinear

    hf = tiny_model("llama")
    model = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), 64, quantization="int4")
    moved = move_to_huge_pages(model, min_bytes=0)
    arena = sorted(p.data_ptr() for p in model.parameters())
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert quantized and moved > 0
    for m in quantized:
        for t in (m.codes, m.scales) + (() if m.extra is None else (m.extra,)):
            assert arena[0] <= t.data_ptr() < arena[0] + moved
