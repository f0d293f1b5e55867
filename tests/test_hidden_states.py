"""Hidden states (``SamplingParams.return_hidden_states``): every fed token's states after the
embedding, each decoder layer and the final norm, as transformers' ``output_hidden_states``
gives them, whatever the chunking, drafter, prefix cache or preemption; the tokens unchanged.
Attentions (``return_attentions``): each layer's probabilities at the same positions, as its
``output_attentions`` gives them."""

import pytest
import torch

from specdec import SamplingParams
from tests.tiny import byte_tokenizer, tiny_model

PROMPTS = [list(range(10, 40)) * 3, [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [7] * 13, [200]]
STATES = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_hidden_states=True)


def reference(hf_model, tokens: list[int]) -> torch.Tensor:  # [layers + 1, T, hidden]
    with torch.no_grad():
        out = hf_model(torch.tensor([tokens]), output_hidden_states=True)
    return torch.stack([h[0] for h in out.hidden_states])


def assert_matches_reference(out, hf_model) -> None:  # noqa: ANN001
    fed = out.prompt_token_ids + out.token_ids[:-1]  # the last token is never fed
    assert out.hidden_states is not None
    expected = reference(hf_model, fed)
    assert out.hidden_states.shape == expected.shape
    torch.testing.assert_close(out.hidden_states, expected, atol=5e-5, rtol=1e-4)


def assert_attentions_match(out, hf_model) -> None:  # noqa: ANN001
    """Position p's row of each layer's probabilities, as eager attention computes them."""
    fed = out.prompt_token_ids + out.token_ids[:-1]
    hf_model.config._attn_implementation = "eager"  # the implementation that returns them
    with torch.no_grad():
        expected = hf_model(torch.tensor([fed]), output_attentions=True).attentions
    assert out.attentions is not None and len(out.attentions) == len(fed)
    for p, probs in enumerate(out.attentions):
        assert probs.shape == (len(expected), expected[0].shape[1], p + 1)
        for layer, theirs in zip(probs, expected):
            torch.testing.assert_close(layer, theirs[0, :, p, : p + 1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("budget", [1024, 7])  # one chunk, or chunks of 7 tokens beside decodes
def test_states_are_transformers_output_hidden_states_at_every_fed_token(make_llm, budget):
    llm = make_llm(block_size=4, max_num_batched_tokens=budget)
    outputs = llm.generate(PROMPTS, STATES)
    for out in outputs:
        assert_matches_reference(out, llm.hf_model)
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert all(o.hidden_states is None for o in plain)


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model"])
def test_speculation_keeps_the_accepted_positions_only(make_llm, drafter):
    """A verification computes states for every draft; those of rejected drafts are dropped
    (a draft model of other weights, and prompt lookup, have some rejected)."""
    plain = make_llm(block_size=4)
    speculative = {"drafter": drafter, "num_speculative_tokens": 4, "adaptive": False}
    if drafter == "draft_model":  # the target with one layer disturbed: it agrees at times
        draft = tiny_model()
        with torch.no_grad():
            draft.model.layers[1].mlp.down_proj.weight.add_(torch.randn(64, 128) * 0.2)
        speculative |= {"draft_model": draft, "draft_tokenizer": byte_tokenizer()}
    spec = make_llm(block_size=4, speculative=speculative)
    expected = plain.generate(PROMPTS, STATES)
    outputs = spec.generate(PROMPTS, STATES)
    stats = spec.engine.verifier.stats
    assert stats.num_draft_tokens > 0 and 0 < stats.acceptance_rate < 1
    for out, ref in zip(outputs, expected, strict=True):
        assert out.token_ids == ref.token_ids
        assert ref.hidden_states is not None and out.hidden_states is not None
        torch.testing.assert_close(out.hidden_states, ref.hidden_states, atol=1e-5, rtol=1e-5)


def test_a_request_that_asks_is_not_served_from_the_prefix_cache(make_llm):
    llm = make_llm(block_size=4)
    first = llm.generate([PROMPTS[0]], STATES)[0]
    again, plain = llm.generate([PROMPTS[0]] * 2, [STATES, SamplingParams(max_tokens=3)])
    assert again.metrics.num_cached_tokens == 0 and plain.metrics.num_cached_tokens > 0
    assert first.hidden_states is not None and again.hidden_states is not None
    torch.testing.assert_close(again.hidden_states, first.hidden_states)


def test_preemption_keeps_each_position_once(make_llm):
    llm = make_llm(block_size=4, num_kv_blocks=40, max_num_batched_tokens=32)
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, return_hidden_states=True,
        return_attentions=True,
    )  # fmt: skip
    outputs = llm.generate(PROMPTS * 2, params)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    for out in outputs:
        assert_matches_reference(out, llm.hf_model)
        assert_attentions_match(out, llm.hf_model)


@pytest.mark.parametrize("speculate", [False, True])
def test_attentions_are_transformers_output_attentions_at_every_fed_token(make_llm, speculate):
    """Prompt chunks beside decodes, or verifications whose rejected drafts are dropped; a
    request may ask for attentions alone."""
    if speculate:
        llm = make_llm(block_size=4, speculative={"drafter": "prompt_lookup"})
    else:
        llm = make_llm(block_size=4, max_num_batched_tokens=7)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, return_attentions=True)
    for out in llm.generate(PROMPTS, params):
        assert out.hidden_states is None
        assert_attentions_match(out, llm.hf_model)
    stats = llm.engine.verifier.stats
    assert not speculate or 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_streamed_deltas_carry_the_positions_they_decided(make_llm):
    llm = make_llm(max_num_batched_tokens=16)  # the prompt takes several steps
    full = llm.generate(PROMPTS[0], STATES)[0]
    deltas = list(llm.stream(PROMPTS[0], STATES))
    assert len(deltas) > 1
    assert deltas[0].hidden_states is not None
    assert deltas[0].hidden_states.shape[1] == len(PROMPTS[0])  # the prompt's, first token
    for delta in deltas[1:]:  # each later token: the one fed before it
        assert delta.hidden_states is not None
        assert delta.hidden_states.shape[1] == len(delta.token_ids)
    streamed = torch.cat([d.hidden_states for d in deltas], dim=1)  # type: ignore[misc]
    assert full.hidden_states is not None
    torch.testing.assert_close(streamed, full.hidden_states)


def test_a_stop_string_ends_the_states_with_the_kept_tokens(make_llm):
    llm = make_llm(block_size=4)
    free = llm.generate(PROMPTS[1], STATES)[0]
    stop = free.text[3:5]
    params = SamplingParams(
        temperature=0, max_tokens=12, stop=[stop], return_hidden_states=True,
        return_attentions=True,
    )  # fmt: skip
    out = llm.generate(PROMPTS[1], params)[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < len(free.token_ids)
    assert_matches_reference(out, llm.hf_model)
    assert_attentions_match(out, llm.hf_model)


def test_bfloat16_states_are_close_to_transformers(make_llm):
    llm = make_llm(dtype="bfloat16")
    out = llm.generate(PROMPTS[1], STATES)[0]
    assert out.hidden_states is not None and out.hidden_states.dtype == torch.bfloat16
    fed = out.prompt_token_ids + out.token_ids[:-1]
    expected = reference(llm.hf_model, fed)  # float32
    error = (out.hidden_states.float() - expected).abs().max() / expected.abs().max()
    assert error < 0.03


@pytest.mark.parametrize("name", ["return_hidden_states", "return_attentions"])
@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_bad_flags_are_refused(name, bad):
    with pytest.raises(ValueError, match=f"{name} must be true or false"):
        SamplingParams(**{name: bad})
