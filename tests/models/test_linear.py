"""specdec.models.linear: bf16 linears on oneDNN-packed weights, float32 ones on row kernels."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels import cpu_ops
from specdec.models.linear import SMALL_ROWS, PackedLinear, RowLinear, can_prepack, prepack_linears
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
    model = LlamaForCausalLM.from_hf(hf.config, state, 64, batch_invariant=False)
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


@pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("features", [(576, 960), (40, 7)])  # 40: no whole 16-lane blocks
def test_row_linear_rows_do_not_depend_on_the_row_count(
    bias: bool, features: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(*features, bias=bias)
    row_linear = RowLinear(linear)
    x = torch.randn(SMALL_ROWS + 8, features[0])
    with torch.inference_mode():
        one_by_one = torch.cat([row_linear(x[i : i + 1]) for i in range(SMALL_ROWS)])
        for rows in (2, 3, 4, 5, 6, 7, 9, 17, 35, SMALL_ROWS):  # every tile size, 1 to 6 rows
            assert torch.equal(row_linear(x[:rows]), one_by_one[:rows]), rows
        torch.testing.assert_close(one_by_one, linear(x[:SMALL_ROWS]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row_linear(x), linear(x))  # more rows: MKL


def test_float32_linears_use_the_row_kernels() -> None:
    hf = tiny_model("qwen2")  # q/k/v biases
    model = LlamaForCausalLM.from_hf(hf.config, hf.state_dict(), 64)
    assert isinstance(model.layers[0].self_attn.qkv_proj, RowLinear)
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied


@pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
def test_a_batch_invariant_bf16_model_runs_every_linear_on_the_row_kernel() -> None:
    hf = tiny_model("llama")  # tied embeddings
    state = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    model = LlamaForCausalLM.from_hf(hf.config, state, 64)
    assert model.batch_invariant
    rows = [m for m in model.modules() if isinstance(m, RowLinear)]
    assert len(rows) == 4 * hf.config.num_hidden_layers + 1
    assert all(m.max_rows is None and m.weight.dtype == torch.bfloat16 for m in rows)
    assert model.lm_head.weight is model.embed_tokens.weight  # no packed copy of the embedding


@pytest.mark.skipif(not cpu_ops.enabled(), reason="no fused CPU kernels")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("features", [(1536, 576), (576, 960), (40, 7)])
def test_bf16_row_linear_rows_do_not_depend_on_the_row_count(
    bias: bool, features: tuple[int, int]
) -> None:
    """Every row count from 1 to 300 (tiles of 1 to 6 rows, chunks of 256) gives each row the
    bits it gets alone; 1536 inputs is the down projection whose rows oneDNN changes on CPUs
    without AMX."""
    torch.manual_seed(0)
    linear = nn.Linear(*features, bias=bias).to(torch.bfloat16)
    row_linear = RowLinear(linear, max_rows=None)
    x = torch.randn(300, features[0]).to(torch.bfloat16)
    with torch.inference_mode():
        one_by_one = torch.cat([row_linear(x[i : i + 1]) for i in range(300)])
        for rows in [*range(2, 14), 31, 64, 255, 256, 257, 300]:
            assert torch.equal(row_linear(x[:rows]), one_by_one[:rows]), rows
        expected = F.linear(
            x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float()
        )
        torch.testing.assert_close(one_by_one.float(), expected, rtol=1.6e-2, atol=2e-2)
