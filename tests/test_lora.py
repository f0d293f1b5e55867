"""LoRA adapters: PEFT's own model is the reference; batches that mix adapters, speculation and
the prefix cache change no adapter's output; bad adapters and options are refused."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import safetensors.torch
import torch
from peft import LoraConfig, get_peft_model

from specdec import LoRARequest, SamplingParams
from specdec.models import lora as lora_module
from tests.tiny import hf_greedy, tiny_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [list(range(10, 40)), [1, 2, 3, 1, 2, 3, 1, 2, 3], [200] * 5, list(b"hello, hello, hel")]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LOGITS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, return_logits=True)
FIXED_K = {"drafter": "prompt_lookup", "num_speculative_tokens": 4, "adaptive": False}
QUANTIZED_SELF = {"drafter": "quantized_self", "num_speculative_tokens": 3, "adaptive": False}


def make_adapter(hf, path: pathlib.Path, seed: int = 1, targets=ALL, r: int = 4, **options):  # noqa: ANN001, ANN201
    """A random PEFT adapter of ``hf`` saved at ``path`` (B not zero, as after training); the
    PEFT model, which is the reference."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False, **options
    )
    peft_model = get_peft_model(copy.deepcopy(hf), config)
    peft_model.save_pretrained(str(path))
    return peft_model.eval()


def request(path: pathlib.Path, lora_id: int = 1) -> LoRARequest:
    return LoRARequest(path.name, lora_id, str(path))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_adapter_output_is_peft_models_output(make_llm, tmp_path, arch):
    llm = make_llm(arch, enable_lora=True)
    peft_model = make_adapter(llm.hf_model, tmp_path / "a")
    outputs = llm.generate(PROMPTS, GREEDY, lora_request=request(tmp_path / "a"))
    base = llm.generate(PROMPTS, GREEDY)
    for prompt, out, plain in zip(PROMPTS, outputs, base):
        assert out.token_ids == hf_greedy(peft_model, prompt, GREEDY.max_tokens)
        assert plain.token_ids == hf_greedy(llm.hf_model, prompt, GREEDY.max_tokens)
    assert [o.token_ids for o in outputs] != [o.token_ids for o in base]  # the adapter matters


def test_adapter_logits_match_peft(make_llm, tmp_path):
    llm = make_llm(enable_lora=True)
    peft_model = make_adapter(llm.hf_model, tmp_path / "a", targets=("q_proj", "down_proj"))
    out = llm.generate([PROMPTS[0]], LOGITS, lora_request=request(tmp_path / "a"))[0]
    ids = torch.tensor([PROMPTS[0] + out.token_ids])
    with torch.no_grad():
        reference = peft_model(ids).logits[0, len(PROMPTS[0]) - 1 : -1]
    torch.testing.assert_close(out.logits, reference, atol=2e-4, rtol=2e-4)


def test_parts_ranks_and_rslora_follow_peft(make_llm, tmp_path):
    llm = make_llm(enable_lora=True)
    peft_model = make_adapter(
        llm.hf_model, tmp_path / "a", targets=("v_proj", "up_proj", "o_proj"), r=8,
        rank_pattern={"up_proj": 2}, use_rslora=True,
    )  # fmt: skip
    out = llm.generate([PROMPTS[0]], LOGITS, lora_request=request(tmp_path / "a"))[0]
    ids = torch.tensor([PROMPTS[0] + out.token_ids])
    with torch.no_grad():
        reference = peft_model(ids).logits[0, len(PROMPTS[0]) - 1 : -1]
    torch.testing.assert_close(out.logits, reference, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_mixing_adapters_changes_no_row(make_llm, tmp_path, dtype):
    """Base, adapter A and adapter B requests in one batch give the very logits each gives
    alone: every row's result is independent of the step."""
    llm = make_llm(enable_lora=True, max_loras=2, dtype=dtype)
    for name, seed in (("a", 1), ("b", 2)):
        make_adapter(llm.hf_model, tmp_path / name, seed=seed)
    loras = [None, request(tmp_path / "a", 1), request(tmp_path / "b", 2)]
    jobs = [(p, lora) for p in PROMPTS for lora in loras]
    mixed = llm.generate([p for p, _ in jobs], LOGITS, lora_request=[lora for _, lora in jobs])
    for (prompt, lora), out in zip(jobs, mixed):
        alone = llm.generate([prompt], LOGITS, lora_request=lora)[0]
        assert out.token_ids == alone.token_ids
        assert torch.equal(out.logits, alone.logits)


@pytest.mark.parametrize(
    ("dtype", "drafter"),
    [("float32", FIXED_K), ("bfloat16", FIXED_K), ("bfloat16", QUANTIZED_SELF)],
)
def test_speculation_with_an_adapter_equals_its_plain_decoding(make_llm, tmp_path, dtype, drafter):
    """The drafters are the base model's (quantized_self: the base weights, quantized): they
    draft worse through an adapter, and the output is still the adapter's plain decoding."""
    plain = make_llm(enable_lora=True, dtype=dtype, block_size=4)
    make_adapter(plain.hf_model, tmp_path / "a")
    spec = make_llm(enable_lora=True, dtype=dtype, block_size=4, speculative=drafter)
    lora = request(tmp_path / "a")
    seeded = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=7)
    for params in (GREEDY, seeded):
        expected = plain.generate(PROMPTS, params, lora_request=lora)
        got = spec.generate(PROMPTS, params, lora_request=lora)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert spec.engine.verifier.stats.num_accepted_tokens > 0


def test_prefix_cache_is_kept_apart_per_adapter(make_llm, tmp_path):
    llm = make_llm(enable_lora=True, block_size=4)
    peft_model = make_adapter(llm.hf_model, tmp_path / "a")
    lora = request(tmp_path / "a")
    prompt = PROMPTS[0]
    llm.generate([prompt], GREEDY)  # the base model's blocks of the prompt are cached
    first = llm.generate([prompt], GREEDY, lora_request=lora)[0]
    again = llm.generate([prompt], GREEDY, lora_request=lora)[0]
    base = llm.generate([prompt], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0  # not the base model's K/V
    assert again.metrics.num_cached_tokens > 0  # its own, shared between its requests
    assert base.metrics.num_cached_tokens > 0
    expected = hf_greedy(peft_model, prompt, GREEDY.max_tokens)
    assert first.token_ids == again.token_ids == expected
    assert base.token_ids == hf_greedy(llm.hf_model, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("max_loras", [1, 2])
def test_max_loras_bounds_the_adapters_of_a_step(make_llm, tmp_path, monkeypatch, max_loras):
    steps: list[set[int]] = []
    rows = lora_module.lora_rows

    def recording(chunks):  # noqa: ANN001, ANN202
        steps.append({c.lora_key for c in chunks if c.lora_key})
        return rows(chunks)

    monkeypatch.setattr(lora_module, "lora_rows", recording)
    llm = make_llm(enable_lora=True, max_loras=max_loras, max_cpu_loras=2)
    for name, seed in (("a", 1), ("b", 2)):
        make_adapter(llm.hf_model, tmp_path / name, seed=seed)
    loras = [request(tmp_path / "a", 1), request(tmp_path / "b", 2), None] * 2
    outputs = llm.generate([PROMPTS[0]] * 6, GREEDY, lora_request=loras)
    assert max(len(s) for s in steps) == max_loras
    for out, lora in zip(outputs, loras):
        assert out.token_ids == outputs[loras.index(lora)].token_ids


def test_embedding_through_an_adapter(make_llm, tmp_path):
    llm = make_llm(enable_lora=True)
    peft_model = make_adapter(llm.hf_model, tmp_path / "a")
    got = llm.embed([PROMPTS[0]], lora_request=request(tmp_path / "a"))[0].outputs.embedding
    with torch.no_grad():
        states = peft_model(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states
    expected = torch.nn.functional.normalize(states[-1][0, -1], dim=0)
    torch.testing.assert_close(torch.tensor(got), expected, atol=1e-4, rtol=1e-4)
    assert got != llm.embed([PROMPTS[0]])[0].outputs.embedding


def test_stream_and_chat_take_an_adapter(make_llm, tmp_path):
    llm = make_llm(enable_lora=True)
    make_adapter(llm.hf_model, tmp_path / "a")
    lora = request(tmp_path / "a")
    whole = llm.generate([PROMPTS[0]], GREEDY, lora_request=lora)[0].token_ids
    streamed = [t for d in llm.stream(PROMPTS[0], GREEDY, lora_request=lora) for t in d.token_ids]
    assert streamed == whole
    chat = [{"role": "user", "content": "hi"}]
    with_adapter = llm.chat(chat, GREEDY, lora_request=lora)[0].token_ids
    assert (
        with_adapter == llm.generate(llm.render_chat(chat), GREEDY, lora_request=lora)[0].token_ids
    )


def test_adapters_are_loaded_let_go_and_removed(make_llm, tmp_path):
    llm = make_llm(enable_lora=True, max_cpu_loras=1)
    for name, seed in (("a", 1), ("b", 2)):
        make_adapter(llm.hf_model, tmp_path / name, seed=seed)
    a, b = request(tmp_path / "a", 1), request(tmp_path / "b", 2)
    first = llm.generate([PROMPTS[0]], GREEDY, lora_request=a)[0].token_ids
    assert llm.engine.list_loras() == {1}
    llm.generate([PROMPTS[0]], GREEDY, lora_request=b)  # a was idle: let go for b
    assert llm.engine.list_loras() == {2}
    assert llm.generate([PROMPTS[0]], GREEDY, lora_request=a)[0].token_ids == first  # reloaded
    request_id = llm.engine.add_request(PROMPTS[0], GREEDY, lora_request=a)
    with pytest.raises(ValueError, match="in use"):
        llm.engine.remove_lora(1)
    with pytest.raises(ValueError, match="all 1 loaded LoRA adapters are in use"):
        llm.engine.add_lora(b)
    llm.engine.abort(request_id)
    assert llm.engine.remove_lora(1) and not llm.engine.remove_lora(1)
    assert llm.engine.list_loras() == set()
    assert all(not linear.deltas for linear in llm.engine.runner.model.lora.linears.values())


def test_bad_requests_and_adapters_are_refused(make_llm, tmp_path):
    plain = make_llm()
    make_adapter(plain.hf_model, tmp_path / "a")
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate([PROMPTS[0]], GREEDY, lora_request=request(tmp_path / "a"))
    llm = make_llm(enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=request(tmp_path / "missing"))
    make_adapter(llm.hf_model, tmp_path / "wide", r=8)
    with pytest.raises(ValueError, match="rank 8 is greater than max_lora_rank 4"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=request(tmp_path / "wide"))
    make_adapter(tiny_model(hidden_size=32, intermediate_size=64), tmp_path / "other")
    with pytest.raises(ValueError, match="an adapter for another model"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=request(tmp_path / "other"))
    make_adapter(llm.hf_model, tmp_path / "head", targets=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match="lm_head"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=request(tmp_path / "head"))
    make_adapter(llm.hf_model, tmp_path / "dora", use_dora=True)
    with pytest.raises(ValueError, match="use_dora not supported"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=request(tmp_path / "dora"))
    llm.generate([PROMPTS[0]], GREEDY, lora_request=request(tmp_path / "a", 3))
    with pytest.raises(ValueError, match="loaded as 'a'"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("b", 3, str(tmp_path / "a")))
    assert llm.engine.list_loras() == {3}  # the refused adapters left nothing loaded


def test_a_lone_half_of_a_pair_is_refused(make_llm, tmp_path):
    llm = make_llm(enable_lora=True)
    make_adapter(llm.hf_model, tmp_path / "a", targets=("q_proj",))
    weights = safetensors.torch.load_file(tmp_path / "a" / "adapter_model.safetensors")
    weights = {k: v for k, v in weights.items() if "layers.1" not in k or "lora_A" in k}
    safetensors.torch.save_file(weights, tmp_path / "a" / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="layer 1 q_proj: lora_A and lora_B must both be given"):
        llm.engine.add_lora(request(tmp_path / "a"))
    config = tmp_path / "a" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "peft_type": "IA3"}))
    with pytest.raises(ValueError, match="peft_type 'IA3' is not LORA"):
        llm.engine.add_lora(request(tmp_path / "a"))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_loras": 0}, "max_loras must be positive"),
        ({"max_lora_rank": 0}, "max_lora_rank must be positive"),
        ({"max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras \\(1\\) must be at least"),
    ],
)
def test_bad_lora_options_are_refused(make_llm, options, message):
    with pytest.raises(ValueError, match=message):
        make_llm(enable_lora=True, **options)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", 1, "x"), "lora_name must be a non-empty string"),
        (("a", 0, "x"), "lora_int_id must be positive"),
        (("a", True, "x"), "lora_int_id must be an integer"),
        (("a", 1, ""), "lora_path must name"),
    ],
)
def test_bad_lora_requests_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*args)


def test_beam_search_through_an_adapter(make_llm, tmp_path):
    from specdec import BeamSearchParams

    llm = make_llm(enable_lora=True)
    peft_model = make_adapter(llm.hf_model, tmp_path / "a")
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    best = llm.beam_search([PROMPTS[1]], params, lora_request=request(tmp_path / "a"))[0]
    expected = peft_model.generate(
        torch.tensor([PROMPTS[1]]), max_new_tokens=6, num_beams=2, do_sample=False,
        eos_token_id=None, pad_token_id=0, min_new_tokens=6,
    )  # fmt: skip
    assert best.sequences[0].token_ids == expected[0, len(PROMPTS[1]) :].tolist()


def test_scores_through_an_adapter(make_llm, tmp_path):
    llm = make_llm(enable_lora=True)
    make_adapter(llm.hf_model, tmp_path / "a")
    lora = request(tmp_path / "a")
    texts = ["hello there", "hello world", "zzz"]
    scores = [o.outputs.score for o in llm.score(texts[0], texts[1:], lora_request=lora)]
    vectors = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts, lora_request=lora)]
    expected = [float(torch.dot(vectors[0].double(), v.double())) for v in vectors[1:]]
    assert scores == pytest.approx(expected, abs=1e-6)
    base = [o.outputs.score for o in llm.score(texts[0], texts[1:])]
    assert scores != pytest.approx(base, abs=1e-6)


def test_quantized_self_drafts_through_the_requests_adapter(make_llm, tmp_path):
    """With draft_lora the quantized copy runs each request's adapter too, so it agrees with the
    adapted target about as often as with the base model (without the adapter it almost never
    did: 3-4%), and the output is still the adapter's plain decoding."""
    plain = make_llm(enable_lora=True)
    llm = make_llm(enable_lora=True, speculative={**QUANTIZED_SELF, "draft_lora": True})
    make_adapter(llm.hf_model, tmp_path / "a")
    llm.generate(PROMPTS, GREEDY)
    stats = llm.engine.verifier.stats
    base = stats.acceptance_rate
    drafts, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    outputs = llm.generate(PROMPTS, GREEDY, lora_request=request(tmp_path / "a"))
    through = (stats.num_accepted_tokens - accepted) / (stats.num_draft_tokens - drafts)
    assert through > 0.5 * base > 0.1
    expected = plain.generate(PROMPTS, GREEDY, lora_request=request(tmp_path / "a"))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]


def test_adapters_under_chunking_preemption_and_speculation(make_llm, tmp_path):
    """Long and short prompts through two adapters and the base model, chunked prefill beside
    decodes and verifications, KV so short that sequences are preempted: every output equals its
    request run alone on a roomy engine without speculation."""
    roomy = make_llm(enable_lora=True, max_loras=2)
    for name, seed in (("a", 1), ("b", 2)):
        make_adapter(roomy.hf_model, tmp_path / name, seed=seed)
    tight = make_llm(
        enable_lora=True, max_loras=2, block_size=4, num_kv_blocks=48,
        max_num_batched_tokens=24, speculative=FIXED_K,
    )  # fmt: skip
    torch.manual_seed(3)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (20, 90, 7, 140)] + PROMPTS
    loras = [None, request(tmp_path / "a", 1), request(tmp_path / "b", 2)]
    per_prompt = [loras[i % 3] for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = tight.generate(prompts, params, lora_request=per_prompt)
    for prompt, lora, out in zip(prompts, per_prompt, outputs):
        assert out.token_ids == roomy.generate([prompt], params, lora_request=lora)[0].token_ids
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert tight.engine.verifier.stats.num_accepted_tokens > 0
