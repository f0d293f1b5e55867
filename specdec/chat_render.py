"""Conversations into prompt text through a chat template, with vLLM's chat request options."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

Conversation = list[dict[str, str]]
# apply_chat_template's own arguments, which template variables must not override
CHAT_TEMPLATE_ARGUMENTS = frozenset(
    inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
) - {"self", "kwargs"}


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a conversation is rendered into a prompt (vLLM's chat request fields)."""

    add_generation_prompt: bool = True  # open the assistant's turn after the last message
    continue_final_message: bool = False  # or leave the final message open, to be continued
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    tools: list[Any] | None = None  # functions the model may call (OpenAI's format)
    chat_template: str | None = None  # a Jinja template instead of the tokenizer's own


def render_chat(
    tokenizer: Any,  # noqa: ANN401 - a transformers tokenizer
    conversation: Conversation,
    options: ChatOptions | None = None,
) -> str:
    """The prompt text of ``conversation`` through ``tokenizer``'s chat template.

    ``options`` (:class:`ChatOptions`, as vLLM's chat fields): open the assistant's turn (the
    default), or continue the final message instead (a reply started for the model), and
    extra variables for the template. Raises ``ValueError`` for an empty conversation, both
    options at once, or template variables that name the template's own arguments.
    """
    options = options or ChatOptions()
    if not conversation:
        raise ValueError("conversation is empty: give at least one message")
    if options.add_generation_prompt and options.continue_final_message:
        raise ValueError(
            "add_generation_prompt and continue_final_message cannot both be true: open a "
            "new assistant turn, or continue the final message"
        )
    kwargs = dict(options.chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & CHAT_TEMPLATE_ARGUMENTS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    text = tokenizer.apply_chat_template(
        conversation,
        add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message,
        tools=options.tools,
        chat_template=options.chat_template,
        tokenize=False,
        **kwargs,
    )
    assert isinstance(text, str)
    return text
