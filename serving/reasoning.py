"""``--reasoning-parser``: a reasoning model's thinking split from its answer, as vLLM's reasoning
parsers split it (the chat reply's ``reasoning`` and ``content``).

Reasoning models write their thinking between tags before the answer: DeepSeek-R1 and its
distilled Qwen2 and Llama models, and Qwen3, between ``<think>`` and ``</think>``. Their chat
templates differ in who opens the block: DeepSeek-R1's template ends the prompt with ``<think>``
(the reply starts inside it), Qwen3's leaves the model to write ``<think>`` (and, with
``enable_thinking: false``, closes an empty block in the prompt). So the rule here reads both
sides, the same for either parser name:

- the reply starts inside the thinking block when the prompt ends by opening one (its last
  text is the opening tag), or when the reply itself opens with the tag (after whitespace; the
  tag is dropped);
- inside the block, the text before the first closing tag is ``reasoning`` and the text after
  it ``content`` (None where empty); a reply cut off before the closing tag is all reasoning;
- a reply that never opens the block is all content.

A guided request (a response format, structured outputs, tool_choice "required" or a named
function) is guided only after the closing tag (:func:`guide_after`,
:mod:`specdec.structured.after`): the model thinks freely, then answers in the required form, as
vLLM's reasoning-aware structured outputs do. Where the prompt opens no block, a reply that opens
one itself thinks freely the same way, and one that does not is guided from its first token.

A stream splits the same way, delta by delta: text that may still be the start of a tag is held
back until the next delta decides it, so that the reasoning and content deltas of a stream add
up to the split of the whole reply, wherever the tokens break the tags (tested over every
chunking). The text itself is split, not token ids, so that a tag spelled in several tokens
splits as one spelled in one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.outputs import RequestOutput
    from specdec.serving.guided import GuidedFields

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names; both read <think> ... </think>


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """How one chat request's replies are split: whether its prompt left a thinking block
    open, and whether the reasoning is sent (vLLM's ``include_reasoning``)."""

    opened: bool
    include: bool = True

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.opened)


def reasoning_split(parser: str | None, body: GuidedFields, prompt: str) -> ReasoningSplit | None:
    """The split of a request's replies under the server's ``--reasoning-parser`` (None
    without one)."""
    if parser is None:
        return None
    include = getattr(body, "include_reasoning", True)  # chat's field; the Responses API: true
    return ReasoningSplit(prompt_opens(prompt), include)


def guide_after(split: ReasoningSplit | None, body: GuidedFields) -> dict[str, Any]:
    """Where a guided request's guide starts, as ``SamplingParams`` fields: after the closing
    tag, so that the model thinks freely first (vLLM's reasoning-aware structured outputs),
    straight away when its prompt opens a thinking block, else where the reply opens one
    itself (``guide_after_opening``; a reply that does not is guided from its first token).
    Nothing without a parser or a guide."""
    if split is None or not body.guided():
        return {}
    return (
        {"guide_after": END} if split.opened else {"guide_after": END, "guide_after_opening": START}
    )


def prompt_opens(prompt: str) -> bool:
    """Whether the rendered prompt ends by opening a thinking block (its last text, whitespace
    aside, is the opening tag), so that the reply starts in it. Only the end counts: a message
    that mentions the tag opens nothing."""
    return prompt.rstrip().endswith(START)


def split(text: str, opened: bool) -> tuple[str | None, str | None]:
    """A whole reply's ``(reasoning, content)``; ``opened``: the prompt left the block open."""
    stream = ReasoningStream(opened)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    if stream.thought:
        return reasoning, content or None
    return None, content


@dataclass(slots=True)
class ReasoningStream:
    """One reply's split, fed its text delta by delta (see the module docstring)."""

    opened: bool  # the prompt left a thinking block open
    phase: str = "opening"  # "opening" (the reply may still write the tag), "thinking", "answering"
    held: str = ""  # text not yet given out: it may be the start of a tag
    thought: bool = False  # the reply is (or was) inside a thinking block

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that ``text`` (the next delta) lets out now."""
        self.held += text
        if self.phase == "opening":
            stripped = self.held.lstrip()
            if START.startswith(stripped):  # whitespace, or part of the opening tag: wait
                return "", ""
            if stripped.startswith(START):  # the reply writes the tag (again, if opened)
                self.held = stripped[len(START) :]
            self.thought = self.opened or stripped.startswith(START)
            self.phase = "thinking" if self.thought else "answering"
        reasoning = ""
        if self.phase == "thinking":
            end = self.held.find(END)
            if end < 0:  # all reasoning so far, but for what may begin the closing tag
                cut = len(self.held) - _partial_tag(self.held, END)
                reasoning, self.held = self.held[:cut], self.held[cut:]
                return reasoning, ""
            reasoning, self.held = self.held[:end], self.held[end + len(END) :]
            self.phase = "answering"
        content, self.held = self.held, ""
        return reasoning, content

    def feed_delta(self, delta: RequestOutput) -> tuple[str, str]:
        """The reasoning and the content a streamed delta lets out, with what was held back
        when it is the last."""
        reasoning, content = self.feed(delta.text)
        if delta.finished:
            more_reasoning, more_content = self.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply has ended: reasoning inside the block (or where
        the prompt opened one), else content."""
        held, self.held = self.held, ""
        if self.phase == "thinking" or (self.phase == "opening" and self.opened):
            self.thought = True
            return held, ""
        return "", held


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (0 if none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
