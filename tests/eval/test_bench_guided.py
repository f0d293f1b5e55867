"""specdec bench --modes guided: grammar-guided tasks with and without drafters."""

from dataclasses import replace

from tests.tiny import byte_tokenizer, tiny_model


def test_guided_mode_times_every_system_and_checks_outputs_against_plain_decoding():
    from specdec.eval.bench.guided import markdown, read_tasks, run_guided
    from specdec.structured.grammar import grammar_regex

    tasks = read_tasks()
    assert len(tasks) >= 16 and {t.category for t in tasks} == {"sql", "json", "list", "label"}
    for task in tasks:
        grammar_regex(task.grammar)  # every task's grammar is one the engine follows
    picked = [replace(t, max_tokens=12) for t in tasks[::5]]
    guided = run_guided(
        rounds=1, tasks=picked, drafters=("prompt_lookup",), model=tiny_model(),
        tokenizer=byte_tokenizer(),
    )  # fmt: skip
    assert list(guided["tokens_per_s"]) == ["specdec", "prompt_lookup"]
    assert guided["vs_plain"]["specdec"]["overall"] == 1
    assert set(guided["vs_plain"]["prompt_lookup"]) == {"overall", *guided["categories"]}
    assert guided["equal_to_plain"]["prompt_lookup"] == f"{len(picked)}/{len(picked)}"
    assert guided["mismatches"] == []
    assert 0 <= guided["speculation"]["prompt_lookup"]["acceptance_rate"] <= 1
    assert "| prompt_lookup |" in markdown(guided)
