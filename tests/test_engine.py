"""Runtime behaviour on tiny random models: exact greedy output, batching, KV hygiene, errors."""

import pytest
import torch

from specdec import SamplingParams
from tests.tiny import VOCAB, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7] * 13, [200], list(range(60, 80)) + [5, 6]]


def assert_matches_transformers(llm, prompts, params=GREEDY):
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(llm.hf_model, prompt, params.max_tokens)
        assert out.finish_reason == "length"
    return outputs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_greedy_matches_transformers_on_mixed_batch(make_llm, arch):
    assert_matches_transformers(make_llm(arch), PROMPTS)


def test_untied_embeddings_and_rope_scaling(make_llm):
    overrides = {
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }
    assert_matches_transformers(make_llm(model_overrides=overrides), PROMPTS[:3])


def test_bfloat16_runs_and_stays_close(make_llm):
    llm = make_llm(dtype="bfloat16")
    outputs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.runner.k_caches[0].dtype == torch.bfloat16
    assert all(len(out.token_ids) == GREEDY.max_tokens for out in outputs)
    # Rounding may flip a near-tie of this random model, but most first tokens agree with
    # float32 transformers (a wrong bf16 path would agree with none).
    agree = [
        out.token_ids[0] == hf_greedy(llm.hf_model, p, 1)[0] for p, out in zip(PROMPTS, outputs)
    ]
    assert sum(agree) >= len(PROMPTS) - 1


def test_chunked_prefill_small_blocks_and_tiny_budget(make_llm):
    llm = make_llm(block_size=2, max_num_batched_tokens=7)
    assert_matches_transformers(llm, PROMPTS)


def test_preemption_under_a_small_kv_pool_changes_no_output(make_llm):
    llm = make_llm(block_size=4, num_kv_blocks=22, max_num_batched_tokens=32)
    outputs = assert_matches_transformers(llm, PROMPTS)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0


def test_prefix_cache_hits_change_no_output(make_llm):
    llm = make_llm(block_size=4)
    shared = list(range(100, 140))
    prompts = [shared + [1, 2], shared + [3], shared + [4, 5, 6]]
    llm.generate(prompts[:1], GREEDY)
    outputs = assert_matches_transformers(llm, prompts)
    assert all(o.metrics.num_cached_tokens >= 40 for o in outputs)


def test_continuations_copy_the_cached_partial_block_and_change_no_output(make_llm):
    """A request that continues an earlier one's tokens (a conversation's next turn, a beam one
    token longer) copies the K/V of the earlier one's last, partial block instead of computing
    it again: the same output as an engine without a prefix cache."""
    llm = make_llm(block_size=4)
    plain = make_llm(block_size=4, enable_prefix_caching=False)
    prompt = list(range(100, 118))
    first = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    out = llm.generate([prompt], first)[0].token_ids  # 26 tokens computed: 6 blocks and 2
    later = [prompt + out, prompt + out + [5, 6, 7], prompt + out[:-2] + [8, 9]]
    params = [SamplingParams(temperature=t, seed=3, max_tokens=12) for t in (0, 1, 0)]
    outputs = llm.generate(later, params)
    assert [o.metrics.num_cached_tokens for o in outputs] == [26, 26, 24]  # the last: 6 blocks
    expected = plain.generate(later, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]


def test_prompts_arriving_together_prefill_their_shared_blocks_once(make_llm):
    """The n choices of a request (and prompts with a common preamble) wait while the first
    prefills the blocks they share, then take them from the prefix cache: every prompt token
    is computed once, and the output is that of an engine without a prefix cache."""
    preamble = list(range(100, 150))
    prompts = [preamble + [1, 2]] * 4 + [preamble + [3], preamble[:30] + [4, 5]]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=8) for i, t in enumerate([0, 1] * 3)]
    llm = make_llm(block_size=4, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, params)
    plain = make_llm(block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(prompts, params)]
    cached = [o.metrics.num_cached_tokens for o in outputs]
    assert cached == [0, 48, 48, 48, 48, 28]  # whole blocks, the last token always computed
    assert llm.reset_prefix_cache()  # vLLM's LLM method
    one_token = llm.generate([prompts[0]] * 3, SamplingParams(max_tokens=1))  # ends at once
    assert [o.metrics.num_cached_tokens for o in one_token] == [0, 48, 48]
    scored = SamplingParams(max_tokens=2, prompt_logprobs=0)  # skips the cache: never waits
    again = llm.generate([prompts[0]] * 2, [scored, SamplingParams(max_tokens=2)])
    assert [o.metrics.num_cached_tokens for o in again] == [0, 48]


def test_max_num_seqs_limits_the_running_batch(make_llm):
    llm = make_llm(max_num_seqs=2)
    for prompt in PROMPTS:
        llm.engine.add_request(prompt, GREEDY)
    widest = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        widest = max(widest, len(llm.engine.scheduler.running))
    assert widest == 2
    assert_matches_transformers(llm, PROMPTS)


def test_eos_and_stop_token_ids_end_generation(make_llm):
    llm = make_llm()
    free_run = llm.generate([PROMPTS[1]], GREEDY)[0].token_ids
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    out = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at])
    )[0]
    assert out.token_ids == free_run[: first + 1] and out.finish_reason == "stop"
    llm.engine.eos_token_ids = (stop_at,)  # the model's EOS behaves the same, unless ignored
    eos_run = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24))[0]
    assert eos_run.token_ids == free_run[: first + 1] and eos_run.finish_reason == "stop"
    assert llm.generate([PROMPTS[1]], GREEDY)[0].token_ids == free_run  # GREEDY ignores EOS


def test_stop_strings_cut_text_and_tokens(make_llm):
    llm = make_llm()
    full = llm.generate(["hello"], GREEDY)[0]
    stop = full.text[6:9]
    assert stop and stop in full.text
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert full.token_ids[: len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < len(full.token_ids)


def test_a_tiny_temperature_decodes_greedily(make_llm):
    """1e-45 once made every probability NaN, and token 0 won every step."""
    llm = make_llm()
    greedy = llm.generate(PROMPTS, GREEDY)
    for temperature in (1e-45, 1e-46):  # 1e-46 is 0 in float32, 1e-45 a subnormal
        params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=1)
        tiny = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]


def test_stream_deltas_concatenate_to_generate(make_llm):
    llm = make_llm()
    whole = llm.generate(["stream me"], GREEDY)[0]
    deltas = list(llm.stream("stream me", GREEDY))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text


def test_streams_read_in_turns_and_beside_generate_lose_no_delta(make_llm):
    """Each call that steps the engine queues open streams' deltas for them: two streams read
    alternately, and a ``generate`` and an ``embed`` call between their reads."""
    llm = make_llm()
    texts = ["stream me", "and me too"]
    whole = [o.token_ids for o in llm.generate(texts, GREEDY)]
    streams = [llm.stream(t, GREEDY) for t in texts]
    got: list[list[int]] = [[], []]
    got[0] += next(streams[0]).token_ids
    assert llm.generate(["q"], GREEDY)[0].token_ids == llm.generate(["q"], GREEDY)[0].token_ids
    llm.embed(["between"])
    done = [False, False]
    while not all(done):
        for i, stream in enumerate(streams):
            if not done[i]:
                delta = next(stream)
                got[i] += delta.token_ids
                done[i] = delta.finished
    assert got == whole
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_closing_a_stream_early_frees_its_blocks(make_llm):
    llm = make_llm()
    stream = llm.stream("abandon me", GREEDY)
    next(stream)
    stream.close()
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(make_llm):
    llm = make_llm()
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate(["abc"], seeded)[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)] * 3
    batched = llm.generate(["xyz", "abc", "hello", "q"], [others[0], seeded, *others[1:]])
    assert batched[1].token_ids == alone
    assert (
        llm.generate(
            ["abc"], SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True)
        )[0].token_ids
        != alone
    )


def test_metrics_count_steps_and_time_to_first_token(make_llm):
    out = make_llm().generate([PROMPTS[0]], GREEDY)[0]
    assert out.metrics.num_steps == GREEDY.max_tokens
    assert out.metrics.time_to_first_token is not None and out.metrics.time_to_first_token >= 0
    assert out.metrics.num_draft_tokens == 0


def test_chat_applies_the_template(make_llm):
    llm = make_llm()
    conversation = [{"role": "user", "content": "hi"}]
    expected = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    out = llm.chat(conversation, GREEDY)[0]
    assert out.prompt_token_ids == list(getattr(expected, "input_ids", expected))
    with pytest.raises(ValueError, match="conversation is empty"):
        llm.chat([[]], GREEDY)


def test_chat_takes_a_template_of_its_own(make_llm):
    """LLM.chat(chat_template=...), as vLLM's: that template instead of the tokenizer's."""
    llm = make_llm()
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}>"
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template=template)[0]
    assert llm.decode(out.prompt_token_ids) == "[user] hi>"
    assert out.token_ids == llm.generate("[user] hi>", GREEDY)[0].token_ids


def test_chat_can_continue_the_final_message_and_pass_template_variables(make_llm):
    llm = make_llm()
    started = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": '{"a":'}]
    out = llm.chat(started, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert llm.decode(out.prompt_token_ids) == '<user>hi\n<assistant>{"a":'  # left open
    closed = llm.chat(started, GREEDY, add_generation_prompt=False)[0]
    assert llm.decode(closed.prompt_token_ids) == '<user>hi\n<assistant>{"a":\n'
    llm.tokenizer.chat_template = (
        "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    greeted = llm.chat(started[:1], GREEDY, chat_template_kwargs={"greeting": "Hello: "})[0]
    assert llm.decode(greeted.prompt_token_ids) == "Hello: hi"
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(started, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tokenize"):
        llm.chat(started, GREEDY, chat_template_kwargs={"tokenize": True})


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "prompt is empty"),
        ("", "prompt is empty"),
        ([VOCAB + 5], "token ids must lie in"),
        (list(range(1, 200)) * 3, "prompt has 597 tokens"),
    ],
)
def test_bad_prompts_raise_and_leave_the_engine_untouched(make_llm, prompt, message):
    llm = make_llm()
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], prompt], GREEDY)
    assert not llm.engine.has_unfinished()
    assert_matches_transformers(llm, [[1, 2, 3]])


def test_mismatched_params_list_is_rejected(make_llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        make_llm().generate(["a"], [GREEDY, GREEDY])


def test_output_is_cut_at_the_context_limit(make_llm):
    llm = make_llm(max_model_len=40)
    out = llm.generate(
        [list(range(1, 31))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    )[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
