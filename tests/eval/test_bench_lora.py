"""specdec bench --modes lora: decoding through adapters against the engine without one and
against transformers with PEFT."""

from tests.tiny import byte_tokenizer, tiny_model


def test_lora_mode_times_every_system_and_checks_outputs_against_peft(tmp_path):
    from specdec.eval.bench.lora import markdown, run_lora

    conversations = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
    lora = run_lora(
        conversations, 5, tmp_path, rounds=1, model=tiny_model(), tokenizer=byte_tokenizer()
    )
    assert lora["prompts"] == 3 and len(lora["tokens_per_s"]) == 6
    assert lora["vs_engine_single_stream"]["engine, no adapter, single stream"] == 1
    assert lora["outputs_equal_to_peft"] == "3/3"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"lora-adapter-{i}" for i in range(4)]
    assert "engine, 4 adapters mixed, 3 at once" in markdown(lora)
