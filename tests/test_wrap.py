"""``specdec.wrap``: transformers' ``generate`` on the engine, same outputs, same storage."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    TextIteratorStreamer,
    TextStreamer,
    pipeline,
)

import specdec
from specdec import LLM, SamplingParams
from specdec.kernels import cpu_ops
from specdec.loader import UnsupportedModelError
from specdec.models.linear import RowLinear
from tests.tiny import byte_tokenizer, tiny_model

TEXTS = ["hello world", "the quick brown fox jumps over", "a", "speculative decoding is exact"]


def model_and_tokenizer(arch: str = "llama", seed: int = 0):  # noqa: ANN201
    tokenizer = byte_tokenizer()
    model = tiny_model(arch, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    return model, tokenizer


def left_padded(tokenizer, texts: list[str], pad: int = 0):  # noqa: ANN001, ANN201
    rows = [tokenizer.encode(t) for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_transformers(arch, batch):
    model, tokenizer = model_and_tokenizer(arch)
    ids, mask = left_padded(tokenizer, TEXTS[:batch])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    fast = specdec.wrap(model, tokenizer)
    assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=24), expected)
    # the drafters that transformers' own arguments switch on change nothing
    looked_up = fast.generate(
        ids, attention_mask=mask, max_new_tokens=24, prompt_lookup_num_tokens=3
    )
    assert torch.equal(looked_up, expected)
    assistant = tiny_model(arch, seed=1)
    assisted = fast.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=24,
        assistant_model=assistant,
        num_assistant_tokens=4,
    )
    assert torch.equal(assisted, expected)
    assert fast._llm.engine.verifier.stats.num_draft_tokens > 0  # the assistant did draft


def test_output_object_mask_inferred_and_max_length():
    model, tokenizer = model_and_tokenizer()
    ids, mask = left_padded(tokenizer, TEXTS, pad=tokenizer.eos_token_id)
    fast = specdec.wrap(model, tokenizer)
    # no mask: inferred from pad_token_id as transformers does (pad = eos here: none inferred)
    model.generation_config.pad_token_id = 299
    ids = torch.where(mask.bool(), ids, 299)
    expected = model.generate(ids, max_length=ids.shape[1] + 10, do_sample=False)
    out = fast.generate(input_ids=ids, max_length=ids.shape[1] + 10, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)


def test_list_of_eos_ids_stops_each_row_at_the_first():
    model, tokenizer = model_and_tokenizer()
    ids, mask = left_padded(tokenizer, TEXTS)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    new = free[:, ids.shape[1] :]
    eos = [int(new[0, 5]), int(new[1, 8])]  # tokens that end rows 0 and 1 early
    kwargs = dict(attention_mask=mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    expected = model.generate(ids, do_sample=False, **kwargs)
    assert expected.shape[1] < free.shape[1] or bool((expected[:, ids.shape[1] :] == 0).any())
    fast = specdec.wrap(model, tokenizer)
    assert torch.equal(fast.generate(ids, **kwargs), expected)
    # min_new_tokens holds the EOS ids back, as transformers' logits processor does
    kwargs["min_new_tokens"] = 12
    assert torch.equal(fast.generate(ids, **kwargs), model.generate(ids, **kwargs))


def test_engine_stops_at_every_eos_id_of_the_generation_config(make_llm):
    """``LLM`` (and so ``serve``) ends a sequence at any EOS id of the model's generation
    config, as well as at the tokenizer's."""
    plain = make_llm()
    prompt = plain.encode("the quick brown fox")
    free = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0].token_ids
    model = plain.hf_model
    model.generation_config.eos_token_id = [byte_tokenizer().eos_token_id, free[6]]
    llm = LLM(model, tokenizer=byte_tokenizer())
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    assert out.token_ids == free[: free.index(free[6]) + 1] and out.finish_reason == "stop"
    # min_tokens holds every EOS id back
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, min_tokens=20))
    assert len(held[0].token_ids) == 20
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_seeded_sampling_is_reproducible_across_drafters_and_batches():
    model, tokenizer = model_and_tokenizer()
    ids, mask = left_padded(tokenizer, TEXTS)
    fast = specdec.wrap(model, tokenizer)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=True, temperature=0.9)
    torch.manual_seed(7)
    first = fast.generate(ids, **kwargs)
    torch.manual_seed(7)
    again = fast.generate(ids, prompt_lookup_num_tokens=4, **kwargs)
    torch.manual_seed(8)
    other = fast.generate(ids, **kwargs)
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_sampled_distribution_matches_transformers():
    """First sampled tokens follow transformers' distribution after its own warpers
    (temperature, and its default top_k=50): a chi-square test that fails on a wrong warper."""
    model, tokenizer = model_and_tokenizer()
    model.generation_config.pad_token_id = None
    prompt = tokenizer.encode("once upon a time")
    logits = model(torch.tensor([prompt])).logits[0, -1] / 1.5
    kept = logits.topk(50).indices
    probs = torch.softmax(logits[kept].double(), dim=-1).detach().numpy()
    fast = specdec.wrap(model, tokenizer)
    n = 1500
    ids = torch.tensor([prompt] * n)
    torch.manual_seed(0)
    out = fast.generate(ids, max_new_tokens=1, do_sample=True, temperature=1.5)[:, -1]
    assert set(out.tolist()) <= set(kept.tolist())  # top_k=50 applied
    index = {int(t): i for i, t in enumerate(kept)}
    counts = np.bincount([index[int(t)] for t in out], minlength=50)
    expected = probs * n
    order = np.argsort(expected)  # pool the rarest tokens into one bin of at least 5 expected
    rare = order[np.cumsum(expected[order]) < 5]
    common = np.setdiff1d(np.arange(50), rare)
    observed = [*counts[common], counts[rare].sum()] if len(rare) else counts[common]
    pooled = np.array([*expected[common], expected[rare].sum()] if len(rare) else expected)
    assert chisquare(observed, pooled * n / pooled.sum()).pvalue > 1e-4


def test_streamer_receives_prompt_then_tokens(capsys):
    model, tokenizer = model_and_tokenizer()
    ids = torch.tensor([tokenizer.encode("hello world")])
    fast = specdec.wrap(model, tokenizer)
    out = fast.generate(ids, max_new_tokens=12, streamer=TextStreamer(tokenizer, skip_prompt=True))
    printed = capsys.readouterr().out
    assert printed.strip() == tokenizer.decode(out[0, ids.shape[1] :]).strip()
    with pytest.raises(ValueError, match="batch size 1"):
        fast.generate(ids.repeat(2, 1), max_new_tokens=4, streamer=TextStreamer(tokenizer))
    # the iterator streamer, read while generate runs in another thread, as its docs show
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    worker = threading.Thread(
        target=fast.generate, args=(ids,), kwargs=dict(max_new_tokens=12, streamer=streamer)
    )
    worker.start()
    text = "".join(streamer)
    worker.join()
    assert text.strip() == printed.strip()


def test_num_return_sequences_expands_rows():
    model, tokenizer = model_and_tokenizer()
    ids, mask = left_padded(tokenizer, TEXTS[:2])
    fast = specdec.wrap(model, tokenizer)
    out = fast.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=True, num_return_sequences=3
    )
    assert out.shape[0] == 6 and torch.equal(out[:3, : ids.shape[1]], ids[:1].expand(3, -1))


@pytest.mark.parametrize("kernels", [True, False], ids=["packed", "plain"])
def test_weights_are_shared_not_copied(kernels: bool, monkeypatch: pytest.MonkeyPatch):
    """Embeddings and norms are the model's own tensors; the linears too where no CPU kernel
    packs them (with the kernels, each is a packed copy)."""
    if not kernels:
        monkeypatch.setattr(cpu_ops, "enabled", lambda: False)
    model, tokenizer = model_and_tokenizer("qwen2")  # q/k/v biases too
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    fast = specdec.wrap(model, tokenizer)
    for name, p in model.named_parameters():  # the same parameters, with the same values
        assert p is before[name][0] and torch.equal(p, before[name][1]), name
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed = {id(m.packed) for m in fast.native.modules() if isinstance(m, RowLinear)}
    assert kernels == bool(packed)
    native = {
        p.untyped_storage().data_ptr() for p in fast.native.parameters() if id(p) not in packed
    }
    assert native <= storages  # every other native weight lies in the model's own memory
    if not kernels:
        layer, ours = model.model.layers[0], fast.native.layers[0]
        q, qkv = layer.self_attn.q_proj.weight, ours.self_attn.qkv_proj.weight
        assert q.data_ptr() == qkv.data_ptr()  # q is the fused matrix's first rows
    # an in-place change to the model's embedding is seen by the engine: one copy of it
    ids = torch.tensor([tokenizer.encode("hello")])
    first = fast.generate(ids, max_new_tokens=6)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(-1.0)
    assert not torch.equal(fast.generate(ids, max_new_tokens=6), first)


def test_wrong_arguments_are_refused():
    model, tokenizer = model_and_tokenizer()
    fast = specdec.wrap(model, tokenizer)
    ids = torch.tensor([tokenizer.encode("hi")])
    with pytest.raises(ValueError, match="not used by the model.*max_new_token"):
        fast.generate(ids, max_new_token=4)
    with pytest.raises(ValueError, match=r"num_beam_groups=2\) is not supported"):
        fast.generate(ids, num_beams=4, num_beam_groups=2, diversity_penalty=0.5)
    with pytest.raises(ValueError, match=r"penalty_alpha=0.6\) is not supported"):
        fast.generate(ids, penalty_alpha=0.6, top_k=4)
    with pytest.raises(ValueError, match=r"top_h=0.5\) is not supported"):
        fast.generate(ids, do_sample=True, top_h=0.5)  # accepted before, and not applied
    with pytest.raises(ValueError, match=r"token_healing=True\) is not supported"):
        fast.generate(ids, token_healing=True)
    with pytest.raises(ValueError, match=r"typical_p must be a number in \(0, 1\]"):
        fast.generate(ids, do_sample=True, typical_p=1.5)
    with pytest.raises(ValueError, match="sequence_bias must be"):
        fast.generate(ids, sequence_bias={(5, -1): -1.0})
    padded, mask = left_padded(tokenizer, TEXTS[:2])
    with pytest.raises(ValueError, match="repetition_penalty with padded rows"):
        fast.generate(padded, attention_mask=mask, repetition_penalty=1.3)
    with pytest.raises(ValueError, match="strictly positive"):
        fast.generate(ids, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="max_length"):
        fast.generate(ids, max_length=1)
    with pytest.raises(ValueError, match="not both"):
        fast.generate(ids, assistant_model=model, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="no token under its attention_mask"):
        fast.generate(ids, attention_mask=torch.zeros_like(ids), max_new_tokens=2)


def test_models_the_engine_cannot_run_are_refused(monkeypatch):
    tokenizer = byte_tokenizer()
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        specdec.wrap(gpt2, tokenizer)
    model = tiny_model()
    model.hf_device_map = {"model.layers.0": "cpu", "model.layers.1": 0}
    with pytest.raises(ValueError, match="dispatched by accelerate"):
        specdec.wrap(model, tokenizer)
    with pytest.raises(ValueError, match="float16"):
        specdec.wrap(tiny_model().half(), tokenizer)
    on_gpu = tiny_model()
    monkeypatch.setattr(type(on_gpu), "device", property(lambda self: torch.device("cuda:0")))
    with pytest.raises(ValueError, match=r"on cuda:0: specdec.wrap runs on the CPU"):
        specdec.wrap(on_gpu, tokenizer)
    monkeypatch.undo()
    with pytest.raises(TypeError, match="transformers model"):
        specdec.wrap(object(), tokenizer)
    with pytest.raises(ValueError, match="no tokenizer"):
        specdec.wrap(tiny_model())


@pytest.mark.integration
def test_default_model_wrap_equals_its_own_generate():
    """The default model: wrap's batch-1 tensors equal transformers' exactly, and a left-padded
    batch of 4 gives each row transformers' unpadded continuation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.loader import default_model_dir

    path = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "Explain what a hash table is in one sentence.",
    ]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    singles = [tokenizer([t], return_tensors="pt", add_special_tokens=False) for t in texts]
    expected = [model.generate(**s, max_new_tokens=24, do_sample=False) for s in singles]
    fast = specdec.wrap(model, tokenizer)
    for single, reference in zip(singles, expected):
        assert torch.equal(fast.generate(**single, max_new_tokens=24), reference)
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = fast.generate(**batch, max_new_tokens=24, prompt_lookup_num_tokens=5)
    width = batch["input_ids"].shape[1]
    for row, single, reference in zip(out, singles, expected):
        new = reference[0, single["input_ids"].shape[1] :]
        assert torch.equal(row[width : width + len(new)], new)


def test_output_logits_and_scores_match_transformers():
    model, tokenizer = model_and_tokenizer()
    ids, mask = left_padded(tokenizer, TEXTS[:2])
    free = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    eos = int(free[0, ids.shape[1] + 4])  # ends row 0 early: its later steps are padding
    kwargs = dict(
        attention_mask=mask,
        eos_token_id=eos,
        pad_token_id=0,
        max_new_tokens=10,
        min_new_tokens=3,
        return_dict_in_generate=True,
        output_logits=True,
        output_scores=True,
    )
    expected = model.generate(ids, do_sample=False, **kwargs)
    fast = specdec.wrap(model, tokenizer)
    out = fast.generate(ids, prompt_lookup_num_tokens=3, **kwargs)  # rows of drafted steps too
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.logits) == len(expected.logits) == len(out.scores)
    new = out.sequences[:, ids.shape[1] :]
    ended = (new == eos).cumsum(1)
    running = (ended == 0) | ((ended == 1) & (new == eos))  # [B, steps] generating then
    assert not bool(running.all())  # a row ended early: the padded steps are skipped below
    for step, (ours, theirs) in enumerate(zip(out.logits, expected.logits)):
        rows = running[:, step]
        torch.testing.assert_close(ours[rows], theirs[rows], atol=1e-4, rtol=1e-4)
    transition = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    reference = model.compute_transition_scores(
        expected.sequences, expected.scores, normalize_logits=True
    )
    torch.testing.assert_close(transition[running], reference[running], atol=1e-4, rtol=1e-4)
    # sampled: scores are log-probabilities after the warpers, top_k=5 keeps 5 per row
    sampled = fast.generate(ids, do_sample=True, top_k=5, **kwargs)
    assert all(bool((torch.isfinite(s).sum(-1) == 5).all()) for s in sampled.scores[3:4])
    assert fast.generate(ids, attention_mask=mask, max_new_tokens=4).dim() == 2


def test_wrapping_twice_fuses_once(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cpu_ops, "enabled", lambda: False)  # native linears on the model's storage
    model, tokenizer = model_and_tokenizer()
    first = specdec.wrap(model, tokenizer)
    second = specdec.wrap(model, tokenizer)
    qkv = [w.native.layers[1].self_attn.qkv_proj.weight for w in (first, second)]
    assert (
        qkv[0].data_ptr()
        == qkv[1].data_ptr()
        == model.model.layers[1].self_attn.q_proj.weight.data_ptr()
    )


def test_a_text_generation_pipeline_runs_on_the_wrapped_model():
    """transformers' pipeline calls generate: the same text as on the model itself."""
    model, tokenizer = model_and_tokenizer()
    options = dict(max_new_tokens=12, do_sample=False)
    expected = pipeline("text-generation", model=model, tokenizer=tokenizer)(TEXTS[1], **options)
    fast = pipeline("text-generation", model=specdec.wrap(model, tokenizer), tokenizer=tokenizer)
    assert fast(TEXTS[1], **options) == expected
    assert fast.model.generate.__self__.__class__.__name__ == "WrappedModel"
