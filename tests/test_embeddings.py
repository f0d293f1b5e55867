"""Embeddings (``LLM.embed``, :mod:`specdec.pooling`): a prompt's final-norm states pooled as
vLLM pools a decoder-only model's (the last token's, the mean, or the first's), equal to
transformers' last hidden state whatever the chunking, batch, drafter, prefix cache or
preemption, and without changing a token of the generation beside them."""

import pytest
import torch

from specdec import SamplingParams
from specdec.engine_config import EngineConfig
from specdec.llm import merge_delta
from specdec.outputs import RequestOutput
from specdec.pooling import PoolingParams

PROMPTS = [list(range(10, 40)) * 3, [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [7] * 13, [200]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def reference(hf_model, tokens: list[int], pooling_type: str, normalize: bool = True):  # noqa: ANN001, ANN201
    """transformers' final-norm states of ``tokens``, pooled."""
    with torch.no_grad():
        states = hf_model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    pooled = {"last": states[-1], "mean": states.mean(dim=0), "cls": states[0]}[pooling_type]
    return torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled


def vectors(outputs) -> list[torch.Tensor]:  # noqa: ANN001
    return [torch.tensor(o.outputs.embedding) for o in outputs]


def run_together(llm, generate: list[list[int]], embed: list[list[int]], params=GREEDY):  # noqa: ANN001, ANN201
    """Generations and embedding requests added to one engine together, stepped to the end:
    each generation's final output, then each embedding request's."""
    ids = [llm.engine.add_request(p, params) for p in generate]
    ids += [llm.engine.add_request(p, PoolingParams()) for p in embed]
    outputs = {i: RequestOutput(i, []) for i in ids}
    while llm.engine.has_unfinished():
        for delta in llm.engine.step():
            merge_delta(outputs[delta.request_id], delta)
    return [outputs[i] for i in ids[: len(generate)]], [outputs[i] for i in ids[len(generate) :]]


@pytest.mark.parametrize("pooling_type", ["last", "mean", "cls"])
@pytest.mark.parametrize("budget", [1024, 7])  # one chunk, or chunks of 7 tokens
def test_embeddings_are_transformers_final_states_pooled(make_llm, pooling_type, budget):
    llm = make_llm(block_size=4, max_num_batched_tokens=budget, pooling_type=pooling_type)
    outputs = llm.embed(PROMPTS)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for prompt, vector in zip(PROMPTS, vectors(outputs), strict=True):
        assert vector.shape == (64,)
        torch.testing.assert_close(vector, reference(llm.hf_model, prompt, pooling_type))
        assert abs(vector.norm().item() - 1) < 1e-5


def test_unnormalized_embeddings_are_the_raw_pooled_states(make_llm):
    llm = make_llm(block_size=4, pooling_type="mean")
    raw, unit = llm.embed(PROMPTS[:2], [PoolingParams(normalize=False), PoolingParams()])
    expected = reference(llm.hf_model, PROMPTS[0], "mean", normalize=False)
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), expected)
    assert abs(torch.tensor(raw.outputs.embedding).norm().item() - 1) > 0.1
    assert abs(torch.tensor(unit.outputs.embedding).norm().item() - 1) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_last_token_embeddings_do_not_depend_on_the_batch(make_llm, dtype):
    """Bit for bit: alone, or in a step of prompt chunks and decodes, or after a prefix-cache
    hit (the batch-invariant kernels give each row its bits alone)."""
    llm = make_llm(block_size=4, dtype=dtype)
    alone = [vectors(llm.embed([p]))[0] for p in PROMPTS]
    busy = make_llm(block_size=4, dtype=dtype, max_num_batched_tokens=9)
    # decodes running while the embeddings' prompts are chunked in beside them
    _, mixed = run_together(busy, [p[::-1] for p in PROMPTS], PROMPTS)
    cached = llm.embed(PROMPTS)  # every prompt's blocks are cached by now
    assert llm.engine.scheduler.block_manager.cached_blocks
    for a, b, c in zip(alone, mixed, vectors(cached), strict=True):
        assert torch.equal(a, b.embedding) and torch.equal(a, c)


def test_only_the_last_token_pooler_takes_prefixes_from_the_cache(make_llm):
    for pooling_type, cached in (("last", True), ("mean", False), ("cls", False)):
        llm = make_llm(block_size=4, pooling_type=pooling_type)
        first = vectors(llm.embed([PROMPTS[0]]))[0]
        _, (out,) = run_together(llm, [], [PROMPTS[0]])
        assert (out.metrics.num_cached_tokens > 0) == cached, pooling_type
        assert out.embedding is not None
        torch.testing.assert_close(out.embedding, first, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_preempted_embedding_requests_pool_each_position_once(make_llm, pooling_type):
    llm = make_llm(block_size=4, num_kv_blocks=40, max_num_batched_tokens=16,
                   pooling_type=pooling_type)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    embed = [p[::-1] for p in PROMPTS] + [p + [5] * 9 for p in PROMPTS]
    _, outputs = run_together(llm, PROMPTS * 2, embed, params)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    for prompt, out in zip(embed, outputs, strict=True):
        expected = reference(llm.hf_model, prompt, pooling_type)
        torch.testing.assert_close(out.embedding, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model"])
def test_speculation_beside_embeddings_changes_no_token_and_no_vector(make_llm, drafter):
    plain = make_llm(block_size=4)
    speculative: dict = {"drafter": drafter, "num_speculative_tokens": 4, "adaptive": False}
    if drafter == "draft_model":
        speculative |= {"draft_model": plain.hf_model, "draft_tokenizer": plain.tokenizer}
    spec = make_llm(block_size=4, speculative=speculative, max_num_batched_tokens=16)
    expected_tokens = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    expected_vectors = vectors(plain.embed(PROMPTS))
    generated, embedded = run_together(spec, PROMPTS, PROMPTS[::-1])
    assert spec.engine.verifier.stats.num_accepted_tokens > 0
    assert [o.token_ids for o in generated] == expected_tokens
    for a, b in zip(expected_vectors[::-1], embedded, strict=True):
        assert torch.equal(a, b.embedding)


def test_generation_beside_embeddings_is_unchanged(make_llm):
    llm = make_llm(block_size=4, max_num_batched_tokens=8)
    sampled = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=3)
    for params in (GREEDY, sampled):
        expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
        generated, embedded = run_together(llm, PROMPTS, [p[::-1] for p in PROMPTS], params)
        assert [o.token_ids for o in generated] == expected
        assert all(o.token_ids == [] and o.text == "" for o in embedded)  # the token is dropped


def test_truncation_keeps_the_last_tokens(make_llm):
    llm = make_llm(block_size=4)
    whole = vectors(llm.embed([PROMPTS[0][-5:]]))[0]
    for kwargs in ({"truncate_prompt_tokens": 5},
                   {"pooling_params": PoolingParams(truncate_prompt_tokens=5)}):  # fmt: skip
        out = llm.embed([PROMPTS[0]], **kwargs)[0]
        assert out.prompt_token_ids == PROMPTS[0][-5:]
        assert torch.equal(torch.tensor(out.outputs.embedding), whole)


def test_prompts_in_every_form_and_the_output_shape(make_llm):
    llm = make_llm(block_size=4)
    text = llm.embed("hello")[0]
    assert text.prompt == "hello" and text.prompt_token_ids == llm.encode("hello")
    assert text.finished and text.outputs.hidden_size == 64
    ids = llm.embed({"prompt_token_ids": llm.encode("hello")})[0]
    assert ids.prompt is None and ids.outputs.embedding == text.outputs.embedding


def test_bfloat16_embeddings_are_close_to_float32_transformers(make_llm):
    llm = make_llm(block_size=4, dtype="bfloat16")
    for prompt, vector in zip(PROMPTS, vectors(llm.embed(PROMPTS)), strict=True):
        expected = reference(llm.hf_model, prompt, "last")
        assert torch.nn.functional.cosine_similarity(vector, expected, dim=0) > 0.999


def test_bad_requests_are_refused_and_leave_nothing_behind(make_llm):
    llm = make_llm(block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="Matryoshka"):
        PoolingParams(dimensions=8)
    with pytest.raises(ValueError, match="normalize"):
        PoolingParams(normalize="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="pooling_type"):
        EngineConfig(pooling_type="max")
    with pytest.raises(ValueError, match="2 PoolingParams for 1 prompts"):
        llm.embed(["a"], [PoolingParams()] * 2)
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[1, 2], []])
    with pytest.raises(ValueError, match="context holds at most 64"):
        llm.embed([[1, 2], [5] * 80])
    with pytest.raises(TypeError, match="prompt"):
        llm.embed([3.5])  # type: ignore[list-item]
    assert not llm.engine.has_unfinished()
    assert len(llm.embed([[5] * 80], truncate_prompt_tokens=-1)[0].prompt_token_ids) == 63
