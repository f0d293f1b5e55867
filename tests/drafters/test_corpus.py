"""The heads' training corpus: prompts kept apart from the evaluation sets, and prompts the
target writes itself (Magpie)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from specdec.drafters import corpus
from specdec.drafters.corpus import (
    DEFAULT_DATA,
    evaluation_runs,
    generate_corpus,
    read_prompts,
    self_written_prompts,
    word_runs,
)
from specdec.drafters.train_heads import TrainConfig
from tests.tiny import byte_tokenizer, tiny_model

QUOTED = "Please make the store safe for concurrent use with a lock, and explain."


def test_no_training_prompt_quotes_an_evaluation_set():
    """Benchmark figures are measured on text the heads never saw: no user message of the
    training prompts shares an 8-word run with an evaluation set's."""
    banned = evaluation_runs()
    assert len(banned) > 10_000
    quoting = [
        message["content"][:80]
        for conversation in read_prompts(DEFAULT_DATA)
        for message in conversation
        if message["role"] == "user" and word_runs(message["content"]) & banned
    ]
    assert quoting == []


def test_word_runs_ignore_case_and_punctuation():
    assert word_runs("One, two; THREE four five six seven eight!") == {
        ("one", "two", "three", "four", "five", "six", "seven", "eight")
    }
    assert word_runs("too short to hold a run") == set()


@dataclass
class Written:
    text: str
    finish_reason: str


class Writer:
    """A stand-in target that 'writes' the given messages in turn."""

    def __init__(self, texts: list[Written], template: str = "<user>{}</user>") -> None:
        self.texts, self.template, self.calls = texts, template, 0

    def render_chat(self, conversation):
        return self.template.format(conversation[0]["content"])

    def encode(self, text):
        self.opening = text
        return [ord(c) for c in text]

    def generate(self, prompts, params):
        assert all(p == [ord(c) for c in "<user>"] for p in prompts)
        assert all(p.temperature == 1.0 for p in params)
        start = self.calls * len(prompts)
        self.calls += 1
        return [self.texts[(start + i) % len(self.texts)] for i in range(len(prompts))]


def test_self_written_prompts_keep_finished_distinct_unquoting_messages(monkeypatch):
    monkeypatch.setattr(corpus, "evaluation_runs", lambda: word_runs(QUOTED))
    texts = [
        Written("  How do I keep basil alive on a windowsill?  ", "stop"),
        Written("A message the length limit cut off in the middle of", "length"),
        Written("How do I keep basil alive on a windowsill?", "stop"),  # the same again
        Written("short", "stop"),
        Written("Hi! " + QUOTED.upper(), "stop"),  # quotes an evaluation set
        Written("Write a limerick about a lighthouse keeper.", "stop"),
    ]
    writer = Writer(texts)
    assert self_written_prompts(writer, 2, batch=4) == [
        "How do I keep basil alive on a windowsill?",
        "Write a limerick about a lighthouse keeper.",
    ]
    assert writer.opening == "<user>" and writer.calls == 2


def test_self_prompting_fails_clearly(monkeypatch):
    monkeypatch.setattr(corpus, "evaluation_runs", set)
    with pytest.raises(ValueError, match="wrote 0 usable prompts in 8 tries"):
        self_written_prompts(Writer([Written("cut", "length")]), 2, batch=4)
    with pytest.raises(ValueError, match="does not show a user's message"):
        self_written_prompts(Writer([], template="no turns here"), 2)
    with pytest.raises(ValueError, match="self_prompts must be 0 or more"):
        TrainConfig("eagle", "/tmp/x", self_prompts=-1)


def test_the_corpus_holds_the_targets_own_prompts_and_answers(tmp_path):
    """self_prompts: the target writes that many prompts, and they are answered beside the
    file's."""
    from specdec import LLM

    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Tell me about the sea."}) + "\n", encoding="utf-8")
    llm = LLM(tiny_model("llama", 0), tokenizer=byte_tokenizer())
    cfg = TrainConfig("eagle", tmp_path, data=data, self_prompts=3, max_new_tokens=8)
    texts = [llm.tokenizer.decode(s) for s in generate_corpus(llm, cfg)]
    assert len(texts) == 4
    assert sum("Tell me about the sea." in t for t in texts) == 1
    opening = llm.render_chat([{"role": "user", "content": "\x00"}]).split("\x00")[0]
    assert all(t.startswith(opening) for t in texts)
    written = [c[0]["content"] for c in read_prompts(tmp_path / "self_prompts.jsonl")]
    assert len(written) == 3 and all(sum(w in t for t in texts) == 1 for w in written)
