"""specdec.models.linear: bf16 linears on oneDNN-packed weights."""

import pytest
import torch
from torch import nn

from specdec.models.linear import PackedLinear, can_prepack, prepack_linears
from specdec.models.llama import LlamaForCausalLM
from tests.tiny import tiny_model

needs_onednn = pytest.mark.skipif(not can_prepack(torch.bfloat16), reason="no oneDNN bf16")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_packed_linear_computes_what_f_linear_computes(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected, got = linear(x), PackedLinear(linear)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-2)


def test_only_bfloat16_is_packed() -> None:
    assert not can_prepack(torch.float32)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    assert prepack_linears(model) == 0 and isinstance(model[0], nn.Linear)


@needs_onednn
def test_a_bf16_model_is_packed_at_load_and_keeps_its_embedding() -> None:
    hf = tiny_model("llama")  # tied embeddings
    state = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    model = LlamaForCausalLM.from_hf(hf.config, state, 64)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert not linears and len(packed) == 4 * hf.config.num_hidden_layers + 1
    assert torch.equal(model.embed_tokens.weight, state["model.embed_tokens.weight"])
    hidden = torch.randn(2, hf.config.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    expected = hidden @ state["model.embed_tokens.weight"].T
    torch.testing.assert_close(logits, expected, rtol=1.6e-2, atol=1e-2)
    fp32 = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), 64)
    assert not any(isinstance(m, PackedLinear) for m in fp32.modules())
