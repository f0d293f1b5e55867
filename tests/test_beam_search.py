"""Beam search on the engine: transformers' beams where their rules meet (no end-of-sequence
token), greedy decoding at width 1, and endings ranked by the length-penalised score."""

import pytest
import torch

from specdec import BeamSearchParams, SamplingParams

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)), [7] * 13]


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_transformers_beam_search(make_llm, width):
    llm = make_llm(block_size=4)
    outputs = llm.beam_search(PROMPTS, BeamSearchParams(width, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs):
        hf = llm.hf_model.generate(
            torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
            max_new_tokens=8, min_new_tokens=8, eos_token_id=None, pad_token_id=0,
            early_stopping=False, length_penalty=1.0,
        )  # fmt: skip
        expected = [row[len(prompt) :].tolist() for row in hf]
        assert [beam.token_ids for beam in out.sequences] == expected
        scores = [beam.cum_logprob for beam in out.sequences]
        assert scores == sorted(scores, reverse=True)
        with torch.no_grad():  # a beam's score is its tokens' summed logprob under the model
            ids = torch.tensor([prompt + out.sequences[0].token_ids])
            logprobs = torch.log_softmax(llm.hf_model(ids).logits[0, len(prompt) - 1 : -1], -1)
        total = logprobs.gather(1, ids[0, len(prompt) :, None]).sum().item()
        assert out.sequences[0].cum_logprob == pytest.approx(total, abs=1e-3)


def test_width_one_is_greedy_decoding(make_llm):
    llm = make_llm()
    beams = llm.beam_search(PROMPTS, BeamSearchParams(1, max_tokens=10, ignore_eos=True))
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [b.sequences[0].token_ids for b in beams] == [g.token_ids for g in greedy]
    assert beams[0].sequences[0].text == greedy[0].text


def test_an_end_of_sequence_token_completes_a_beam(make_llm):
    llm = make_llm()
    greedy = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, logprobs=3))[0]
    assert greedy.logprobs is not None
    ending = greedy.logprobs[1].top[1][0]  # the runner-up at the second step ends a beam
    llm.engine.eos_token_ids = (ending,)
    out = llm.beam_search(PROMPTS[1], BeamSearchParams(3, max_tokens=6, length_penalty=0.0))[0]
    ended = [b for b in out.sequences if b.finished]
    assert ended and all(b.token_ids[-1] == ending for b in ended)
    assert all(len(b.token_ids) == 6 for b in out.sequences if not b.finished)
    scores = [b.normalized for b in out.sequences]  # length_penalty 0: the logprob sums
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width must be an integer in"),
        ({"beam_width": 11, "max_tokens": 4}, "beam_width must be an integer in"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens must be at least 1"),
        ({"beam_width": 2, "max_tokens": 4, "early_stopping": "soon"}, "early_stopping must be"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature must be"),
    ],
)
def test_bad_beam_search_params_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**options)


def test_temperature_ranks_by_the_scaled_distribution(make_llm):
    llm = make_llm()
    plain = llm.beam_search(PROMPTS, BeamSearchParams(3, max_tokens=6, ignore_eos=True))
    one = llm.beam_search(PROMPTS, BeamSearchParams(3, 6, ignore_eos=True, temperature=1.0))
    assert [[b.token_ids for b in o.sequences] for o in one] == [
        [b.token_ids for b in o.sequences] for o in plain
    ]
    hot = llm.beam_search(PROMPTS[1], BeamSearchParams(3, 6, ignore_eos=True, temperature=3.0))[0]
    prompt = PROMPTS[1]
    for beam in hot.sequences:  # each score sums the tokens' logprobs at temperature 3
        with torch.no_grad():
            ids = torch.tensor([prompt + beam.token_ids])
            rows = llm.hf_model(ids).logits[0, len(prompt) - 1 : -1] / 3.0
        total = torch.log_softmax(rows, -1).gather(1, ids[0, len(prompt) :, None]).sum().item()
        assert beam.cum_logprob == pytest.approx(total, abs=1e-3)


def test_include_stop_str_in_output_keeps_the_ending_tokens_text(make_llm):
    llm = make_llm()
    greedy = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, logprobs=3))[0]
    assert greedy.logprobs is not None
    ending = greedy.logprobs[1].top[1][0]
    llm.engine.eos_token_ids = (ending,)
    params = BeamSearchParams(3, max_tokens=6, length_penalty=0.0)
    for include in (False, True):
        params.include_stop_str_in_output = include
        out = llm.beam_search(PROMPTS[1], params)[0]
        ended = [b for b in out.sequences if b.finished]
        assert ended
        for beam in ended:
            body = llm.engine.detokenizer.decode(beam.token_ids[:-1])
            tail = llm.engine.detokenizer.decode([ending], skip_special_tokens=False)
            assert beam.text == body + (tail if include else "")
