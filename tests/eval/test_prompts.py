"""The shipped prompt sets, the conversation each record stands for, and the checks on loading."""

import json

import pytest

from specdec.eval import prompts
from specdec.eval.prompts import check_record, conversation, load_prompts

CHAT = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7."},
        {"role": "user", "content": "Another?"},
    ],
    "max_tokens": 16,
}


def test_a_prompt_record_is_one_user_turn():
    record = {"prompt": "Summarize: the cat sat.", "max_tokens": 8}
    check_record(record)
    assert conversation(record) == [{"role": "user", "content": "Summarize: the cat sat."}]


def test_a_chat_record_is_its_messages():
    check_record(CHAT)
    assert conversation(CHAT) == CHAT["messages"]


def test_a_record_with_neither_prompt_nor_messages_names_both():
    with pytest.raises(ValueError, match="needs 'prompt' or 'messages'; it has \\['max_tokens'\\]"):
        conversation({"max_tokens": 8})
    with pytest.raises(ValueError, match="needs 'prompt' or 'messages'"):
        check_record({"max_tokens": 8})


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (["a list"], "must be a JSON object, not list"),
        ({"prompt": "hi"}, "'max_tokens' must be a positive integer, not None"),
        ({"prompt": "hi", "max_tokens": 0}, "'max_tokens' must be a positive integer, not 0"),
        ({"prompt": "hi", "max_tokens": 2.5}, "not 2.5"),
        ({"prompt": "hi", "max_tokens": "8"}, "not '8'"),
        ({"prompt": "hi", "max_tokens": True}, "not True"),
        ({"prompt": "  ", "max_tokens": 8}, "'prompt' must be a non-empty string"),
        ({"prompt": ["hi"], "max_tokens": 8}, "'prompt' must be a non-empty string"),
        ({"prompt": "hi", "messages": CHAT["messages"], "max_tokens": 8}, "not both"),
        ({"messages": [], "max_tokens": 8}, "'messages' must be a non-empty list"),
        ({"messages": "hi", "max_tokens": 8}, "'messages' must be a non-empty list"),
        ({"messages": ["hi"], "max_tokens": 8}, "messages\\[0\\] must be"),
        ({"messages": [{"role": "user"}], "max_tokens": 8}, "messages\\[0\\] must be"),
        ({"messages": [{"role": "usr", "content": "hi"}], "max_tokens": 8}, "messages\\[0\\]"),
        ({"messages": [{"role": "user", "content": 3}], "max_tokens": 8}, "messages\\[0\\]"),
        (
            {
                "messages": [*CHAT["messages"], {"role": "assistant", "content": "11."}],
                "max_tokens": 8,
            },
            "the last of 'messages' must be the user's",
        ),
    ],
)
def test_a_bad_record_is_refused_with_what_is_wrong(record, message):
    with pytest.raises(ValueError, match=message):
        check_record(record)


def test_loading_names_the_file_and_line_of_a_bad_record(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts, "PROMPT_DIR", tmp_path)
    good = json.dumps({"prompt": "hi", "max_tokens": 8})
    (tmp_path / "bad.jsonl").write_text(f"{good}\n\n{json.dumps({'prompt': 'hi'})}\n")
    with pytest.raises(ValueError, match="bad.jsonl, line 3: 'max_tokens' must be"):
        load_prompts("bad")
    (tmp_path / "broken.jsonl").write_text(f"{good}\n{{not json\n")
    with pytest.raises(ValueError, match="broken.jsonl, line 2: "):
        load_prompts("broken")
    (tmp_path / "fine.jsonl").write_text(f"{good}\n\n{json.dumps(CHAT)}\n")
    assert load_prompts("fine") == [json.loads(good), CHAT]


def test_an_unknown_set_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown prompt set 'nope'; known sets: \\[.*'runtime'"):
        load_prompts("nope")


def test_the_runtime_mix_has_32_valid_requests():
    assert len(load_prompts("runtime")) == 32
