"""specdec bench --modes embed: LLM.embed against transformers on the same weights."""

from tests.tiny import byte_tokenizer, tiny_model


def test_embed_mode_compares_llm_embed_with_transformers():
    """The embed mode's table on a tiny model: three systems timed, the engine's vectors
    transformers' (float32: equal to rounding; bfloat16: close)."""
    from specdec.eval.bench.embed import markdown, run_embed

    tokenizer = byte_tokenizer()
    texts = [f"question {i} " * (i + 1) for i in range(10)]
    for dtype, floor in (("float32", 0.99999), ("bfloat16", 0.99)):
        embed = run_embed(texts, dtype, rounds=1, model=tiny_model(), tokenizer=tokenizer)
        assert embed["prompts"] == 10 and embed["prompt_tokens"] == sum(map(len, texts))
        assert len(embed["prompts_per_s"]) == 3 and embed["vs_hf"]["hf, one at a time"] == 1
        assert min(embed["min_cosine_vs_hf"].values()) > floor
        assert f"LLM.embed ({dtype})" in markdown(embed)
