"""Code written against vLLM's offline API (``vllm.LLM``) runs here: its prompt forms, keyword
names, output fields, global seed and ``speculative_config``; what has no meaning here fails
with an error that says so."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import LLM, SamplingParams, SpecConfig
from tests.tiny import byte_tokenizer, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_prompt_dicts_and_arrays_are_prompts_too(make_llm):
    llm = make_llm()
    ids = llm.encode("hello there")
    want = [o.token_ids for o in llm.generate(["hello there", ids], GREEDY)]
    forms = [
        {"prompt": "hello there"},
        {"prompt_token_ids": ids},
        torch.tensor(ids),
        np.array(ids, dtype=np.int64),
    ]
    for form in forms:  # alone, and in a batch
        assert llm.generate(form, GREEDY)[0].token_ids == want[0]
    got = llm.generate([forms[0], forms[1], [np.int32(t) for t in ids]], GREEDY)
    assert [o.token_ids for o in got] == [want[0], want[1], want[1]]


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"prompt": "hi", "multi_modal_data": {}}, "one key"),
        ({"text": "hi"}, "one key"),
        ({"prompt_token_ids": "hi"}, "token ids must be integers"),
        ([1.0, 2.0], "token ids must be integers, got float"),
        ([True, 2], "got bool"),
        (torch.ones(2, 3, dtype=torch.long), "must be 1-D"),
        (7, "not int"),
        (b"hi", "not bytes"),
    ],
)
def test_prompts_of_the_wrong_type_raise_a_clear_type_error(make_llm, prompt, message):
    llm = make_llm()
    with pytest.raises(TypeError, match=message):
        llm.generate([[1, 2, 3], prompt], GREEDY)
    assert not llm.engine.has_unfinished()


def test_outputs_read_as_vllm_outputs(make_llm):
    llm = make_llm()
    text, ids = llm.generate(["hello", llm.encode("hello")], sampling_params=GREEDY)
    assert text.prompt == "hello" and ids.prompt is None  # vLLM's: the text, if given as text
    assert text.outputs[0].token_ids == text.token_ids == ids.outputs[0].token_ids
    assert text.outputs[0].text == text.text and text.outputs[0].finish_reason == "length"
    assert text.cumulative_logprob is None  # no logprobs asked for
    scored = llm.generate("hello", SamplingParams(temperature=0, max_tokens=5, logprobs=0))[0]
    assert scored.logprobs is not None
    assert scored.cumulative_logprob == pytest.approx(sum(t.logprob for t in scored.logprobs))
    assert llm.get_tokenizer() is llm.tokenizer
    chat = [{"role": "user", "content": "hi"}]
    reply = llm.chat(chat, sampling_params=GREEDY, use_tqdm=True)[0]
    assert reply.prompt == llm.render_chat(chat)
    assert reply.prompt_token_ids == llm.apply_chat_template(chat)
    streamed = list(llm.stream("hello", sampling_params=GREEDY))
    assert sum((d.token_ids for d in streamed), []) == text.token_ids


def test_n_completions_per_prompt(make_llm):
    llm = make_llm()
    seeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=40, n=3)
    first, second = llm.generate([[1, 2, 3], "hi"], seeded, use_tqdm=True)
    assert len(first.outputs) == len(second.outputs) == 3 and second.outputs[2].prompt == "hi"
    alone = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    for i, completion in enumerate(first.outputs):  # completion i is the request seeded seed + i
        alone.seed = 40 + i
        assert completion.token_ids == llm.generate([[1, 2, 3]], alone)[0].token_ids
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3
    unseeded = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=12, ignore_eos=True, n=2))[0]
    assert unseeded.outputs[0].token_ids != unseeded.outputs[1].token_ids  # seeds of their own
    greedy = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, n=2))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    with pytest.raises(ValueError, match="n must be a positive integer"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="stream gives one completion"):
        next(llm.stream("hi", SamplingParams(n=2)))


def test_special_tokens_and_stops_in_the_text(make_llm):
    llm = make_llm()
    bos = llm.tokenizer.bos_token_id  # a special token, forced by a bias
    forced = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={bos: 100})
    assert llm.generate("hi", SamplingParams(**forced))[0].text == ""
    kept = llm.generate("hi", SamplingParams(**forced, skip_special_tokens=False))[0]
    assert kept.token_ids == [bos] * 3 and kept.text == "<s>" * 3

    free = llm.generate("hello", GREEDY)[0]
    stop_at = free.token_ids[5]
    for include in (False, True):  # vLLM's rule: the stop token's text is left out, or kept
        params = SamplingParams(
            temperature=0,
            max_tokens=24,
            stop_token_ids=[stop_at],
            include_stop_str_in_output=include,
        )
        out = llm.generate("hello", params)[0]
        assert out.token_ids[-1] == stop_at and out.finish_reason == "stop"
        assert out.text == llm.tokenizer.decode(out.token_ids if include else out.token_ids[:-1])
        streamed = "".join(d.text for d in llm.stream("hello", params))
        assert streamed == out.text

    stop = free.text[6:9]
    params = SamplingParams(
        temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True
    )
    out = llm.generate("hello", params)[0]
    assert out.text == free.text[: free.text.index(stop) + len(stop)]
    assert llm.tokenizer.decode(out.token_ids).endswith(stop)  # the fewest tokens holding it
    assert not llm.tokenizer.decode(out.token_ids[:-1]).endswith(stop)
    assert "".join(d.text for d in llm.stream("hello", params)) == out.text


def test_the_engine_seed_repeats_unseeded_sampling():
    def sample(seed):
        llm = LLM(tiny_model("llama", 0), tokenizer=byte_tokenizer(), seed=seed)
        params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
        out = [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5]], params)]
        assert llm.engine.num_free_blocks == llm.engine.num_blocks
        return out

    torch.manual_seed(0)
    first = sample(7)
    torch.manual_seed(1)  # the global RNG does not matter once the engine has a seed
    assert sample(7) == first
    assert sample(8) != first
    with pytest.raises(ValueError, match="seed must be an integer"):
        LLM(tiny_model("llama", 0), tokenizer=byte_tokenizer(), seed="7")


def test_unknown_options_name_themselves_and_the_known_ones():
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'enforce_eager'.*max_num_seqs"):
        LLM(tiny_model("llama", 0), tokenizer=byte_tokenizer(), enforce_eager=True)


@pytest.mark.parametrize(
    ("config", "drafter", "k", "options"),
    [
        ({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}, "prompt_lookup", 5,
         {"prompt_lookup_max": 3}),
        ({"model": "/tmp/draft", "num_speculative_tokens": 4}, "draft_model", 4,
         {"draft_model": "/tmp/draft"}),
        ({"method": "eagle", "model": "/tmp/heads"}, "eagle", 8, {"heads": "/tmp/heads"}),
        ({"method": "medusa"}, "medusa", 8, {"heads": None}),
    ],
)  # fmt: skip
def test_speculative_config_maps_vllm_methods(config, drafter, k, options):
    spec = SpecConfig.from_vllm(config)
    assert (spec.drafter, spec.num_speculative_tokens) == (drafter, k)
    assert {name: getattr(spec.options, name) for name in options} == options


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle3"}, "method 'eagle3' is not supported"),
        ({}, "method None is not supported"),
        ({"method": "ngram", "disable_by_batch_size": 4}, "key 'disable_by_batch_size'"),
        ({"method": "ngram", "model": "/tmp/draft"}, "takes no draft model"),
        ({"method": "eagle", "prompt_lookup_max": 3}, "ngram's, not eagle's"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
    ],
)
def test_unsupported_speculative_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig.from_vllm(config)


def test_speculative_config_runs_and_keeps_the_output(make_llm):
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]]
    plain = [o.token_ids for o in make_llm().generate(prompts, GREEDY)]
    llm = make_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert llm.spec_config is not None and llm.spec_config.drafter == "prompt_lookup"
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == plain
    with pytest.raises(ValueError, match="not both"):
        make_llm(speculative=SpecConfig(), speculative_config={"method": "ngram"})
