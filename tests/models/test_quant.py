"""Quantized models: the wiring of int4/int8 linears, exactness under speculation, and errors."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.drafters import SpecConfig
from specdec.models import quant
from specdec.models.quant import QUANTIZATIONS, QuantLinear, dequantized_linears
from tests.tiny import byte_tokenizer, hf_greedy, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)) * 2, [7] * 13, [42]]
UNTIED = {"tie_word_embeddings": False}  # so that the head can be quantized apart from lookups


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_quantized_model_computes_its_dequantized_weights(make_llm, arch, quantization):
    """Greedy output equals transformers' on the dequantized weights (and, for w4a8 and w8a8,
    each linear's input rounded to int8 per group): every linear (fused q/k/v and gate/up,
    biases, the head) holds the right codes in the right place and the right mode."""
    llm = make_llm(arch, model_overrides=UNTIED, quantization=quantization)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * 2 + 1  # qkv, o, gate_up, down per layer, and the head
    assert {m.bits for m in linears} == ({4, 8} if quantization in ("int4", "w4a8") else {8})
    assert {m.int8_activations for m in linears} == {quantization.endswith("a8")}
    reference = dequantized_linears(tiny_model(arch, **UNTIED), quantization)
    recompute = quantization.endswith("a8")  # see hf_greedy
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert out.token_ids == hf_greedy(reference, prompt, GREEDY.max_tokens, not recompute)


@pytest.mark.parametrize("quantization", ["int4", "w4a8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int4_target_under_speculation_equals_its_plain_decoding(make_llm, dtype, quantization):
    plain = make_llm(dtype=dtype, quantization=quantization, block_size=4)
    spec = {"drafter": "prompt_lookup", "num_speculative_tokens": 5, "adaptive": False}
    fast = make_llm(dtype=dtype, quantization=quantization, block_size=4, speculative=spec)
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in fast.generate(PROMPTS, GREEDY)] == expected
    assert fast.engine.verifier.stats.num_draft_tokens > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("draft_quantization", QUANTIZATIONS)
def test_quantized_self_output_equals_plain_decoding(make_llm, dtype, draft_quantization):
    plain = make_llm(dtype=dtype, block_size=4)
    spec = {
        "drafter": "quantized_self",
        "draft_quantization": draft_quantization,
        "num_speculative_tokens": 4,
        "adaptive": False,
    }
    fast = make_llm(dtype=dtype, block_size=4, speculative=spec)
    assert fast.engine.drafter.name == "quantized_self"
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in fast.generate(PROMPTS, GREEDY)] == expected
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=5, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(PROMPTS, sampled)]
    assert [o.token_ids for o in fast.generate(PROMPTS, sampled)] == expected
    stats = fast.engine.verifier.stats
    # A close copy agrees far above chance (1 in 300 here); int4 is coarse on this tiny random
    # model (about a third accepted), int8 close (over nine in ten).
    floor = 0.2 if draft_quantization in ("int4", "w4a8") else 0.7
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > floor


def test_bad_quantization_requests_get_clear_errors():
    with pytest.raises(
        ValueError, match="unknown quantization 'int3': use one of int8, int4, w8a8, w4a8"
    ):
        LLM(tiny_model(), tokenizer=byte_tokenizer(), quantization="int3")
    with pytest.raises(ValueError, match="draft_quantization must be one of int8, int4, w8a8"):
        SpecConfig(drafter="quantized_self", draft_quantization="fp8")
    with pytest.raises(ValueError, match=r"input width \(48\) is not a multiple of 32"):
        LLM(tiny_model(hidden_size=48), tokenizer=byte_tokenizer(), quantization="int8")


@pytest.mark.parametrize("fast", [False, True])
def test_int8_activations_on_scalar_code_get_a_warning(monkeypatch, caplog, fast):
    """w4a8 and w8a8 are fast only with AVX-512 VNNI or AVX2; elsewhere the user is told what to
    use instead."""
    monkeypatch.setattr(quant, "fast_int8_activations", lambda: fast)
    with caplog.at_level("WARNING", logger="specdec.models.quant"):
        quant.quantize_linears(tiny_model(hidden_size=64), "w4a8")
    assert ("lacks both, so 'w4a8' runs scalar code: use 'int4' here" in caplog.text) != fast
    caplog.clear()
    with caplog.at_level("WARNING", logger="specdec.models.quant"):
        quant.quantize_linears(tiny_model(hidden_size=64), "int4")
    assert caplog.text == ""


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 16},  # prompts in chunks beside decodes and verifications
        {"num_kv_blocks": 24},  # preemption: sequences recomputed, their drafts restarted
        {"enable_prefix_caching": False},
    ],
)
def test_quantized_self_reads_the_targets_cache_in_every_step_shape(make_llm, options):
    """The draft writes K/V only where the target has not computed yet, so sharing the target's
    cache changes no output, whatever the step holds."""
    plain = make_llm(block_size=4, **options)
    spec = {"drafter": "quantized_self", "num_speculative_tokens": 6, "adaptive": False}
    fast = make_llm(block_size=4, speculative=spec, **options)
    draft, target = fast.engine.drafter.runner, fast.engine.runner
    assert draft.k_caches is target.k_caches and draft.v_caches is target.v_caches
    assert draft.model.embed_tokens is target.model.embed_tokens
    # no draft_quantization asked for: w4a8 where the CPU multiplies bytes (VNNI, AVX2), else int4
    a8 = quant.fast_int8_activations()
    linears = [m for m in draft.model.modules() if isinstance(m, QuantLinear)]
    assert {(m.bits, m.int8_activations) for m in linears} == {(4, a8), (8, a8)}
    prompts = PROMPTS + [PROMPTS[1] + [5, 6, 7]]  # a shared prefix for the prefix cache
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert [o.token_ids for o in fast.generate(prompts, GREEDY)] == expected
    assert fast.engine.verifier.stats.num_accepted_tokens > 0
