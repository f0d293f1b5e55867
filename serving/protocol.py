"""Request bodies of the OpenAI-compatible API, validated by pydantic.

Validation is strict, as OpenAI's own API is: ``"5"`` is not an integer and ``true`` is not 1.
Fields this server does not know are ignored, as OpenAI-compatible servers do. Fields it knows but
does not implement (tools, ``best_of``, ...) are rejected when set to anything other than
their neutral value, so that nobody silently gets less than they asked for. ``null`` means "the
default" for every optional field.

Terms:
    choice: one generated sequence of a response; a request has ``n`` choices per prompt.
    extra field: a field OpenAI does not define, taken from vLLM (``top_k``, ``min_p``,
        ``ignore_eos``, ``stop_token_ids``, ``repetition_penalty``, ``guided_choice``, ...) or specdec's own
        (``num_speculative_tokens``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from specdec.chat_render import CHAT_TEMPLATE_ARGUMENTS, ChatOptions
from specdec.config import MAX_LOGPROBS, SamplingParams, choice_seed
from specdec.serving.guided import GuidedFields, guides_given
from specdec.serving.strict import StrictModel, TruncatePromptTokens
from specdec.serving.tools import (
    NamedToolChoice,
    Tool,
    ToolChoiceRules,
    calls_schema,
    check_tool_choice,
    parsed_arguments,
)

MAX_N = 128  # most choices per prompt, as OpenAI allows
_INT64 = 2**63


class StreamOptions(StrictModel):
    include_usage: bool | None = None  # end the stream with a chunk holding the usage
    # with include_usage, every chunk also holds the usage so far (vLLM's extra)
    continuous_usage_stats: bool | None = None


class GenerationFields(GuidedFields):
    """The fields shared by completions and chat completions."""

    model: str | None = None  # the served model's name; None picks the one model served
    max_tokens: int | None = Field(None, ge=1)  # most tokens per choice; None: up to the context
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name; wins over max_tokens
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)  # None: 1.0; 0 is greedy
    top_p: float | None = Field(None, gt=0, le=1)  # nucleus mass; None: 1.0 (disabled)
    top_k: int | None = Field(None, ge=-1, lt=2**31)  # extra; keep the k most likely; 0/-1: all
    min_p: float | None = Field(None, ge=0, le=1)  # extra; relative probability floor; None: 0
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)  # per-request generator seed
    stop: list[str] | None = None  # stop strings (a string or a list); excluded from the text
    stop_token_ids: list[int] | None = None  # extra; token ids that end a choice
    ignore_eos: bool | None = None  # extra; keep generating past the end-of-sequence token
    skip_special_tokens: bool | None = None  # extra; None: true (special tokens left out)
    include_stop_str_in_output: bool | None = None  # extra; None: false (text ends before it)
    min_tokens: int | None = Field(None, ge=0, lt=2**31)  # extra; tokens before a stop id may end
    n: int | None = Field(None, ge=1, le=MAX_N)  # choices per prompt; None: 1
    stream: bool | None = None  # send server-sent events as tokens are produced
    stream_options: StreamOptions | None = None  # only read when streaming
    num_speculative_tokens: int | None = Field(None, ge=0, le=64)  # extra; drafts per step, 0: off
    # extra (vLLM's); each prompt token's logprob and this many alternatives', not streamed
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # extra (vLLM's); logprobs name each token "token_id:<id>" instead of its text, so that a
    # client reads the exact ids (tokens that decode alone to no whole character included)
    return_tokens_as_token_ids: bool | None = None

    # subtract this from every generated token's logit (presence) or this times its count
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    # extra; divide a positive logit of a prompt or output token by it; None: 1 (off)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)

    logit_bias: dict[str, float] | None = None  # token id (a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # extra; only these ids may be generated
    bad_words: list[str] | None = None  # extra; words never generated (vLLM's rule)
    # extra; keep the prompt's last k tokens (-1: as many as leave room for one new token)
    truncate_prompt_tokens: TruncatePromptTokens = None
    # extra (vLLM's); under --scheduling-policy priority, lower values are served first
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    # extra (vLLM's): n beams searched, the n best returned (specdec/serving/beams.py), ranked
    # by logprob sum / length ** length_penalty; early_stopping: transformers' (False, True,
    # "never")
    use_beam_search: bool | None = None
    length_penalty: float | None = Field(None, allow_inf_nan=False)
    early_stopping: bool | str | None = None

    # Known but not implemented: accepted only at their neutral values (see the module docstring).
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        if value is None or (isinstance(value, list) and all(isinstance(s, str) for s in value)):
            return value
        raise ValueError("must be a string or a list of strings")

    @field_validator("early_stopping")
    @classmethod
    def _transformers_early_stopping(cls, value: bool | str | None) -> bool | str | None:
        if value is None or isinstance(value, bool) or value == "never":
            return value
        raise ValueError('must be true, false or "never"')

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_and_bounds(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit() or not token.isascii():
                raise ValueError(f"keys must be token ids (non-negative integers), got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must lie in [-100, 100], got {bias!r} for {token}")
        return value

    @field_validator("*")
    @classmethod
    def _reject_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = cls.NEUTRAL.get(info.field_name or "")
        if neutral is not None and value not in neutral:
            raise ValueError(f"is not supported by this server; leave it unset or {neutral[-1]!r}")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field that set the reply's length, to name in an error."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk of the stream holds the usage so far."""
        options = self.stream_options
        return self.include_usage and bool(options and options.continuous_usage_stats)

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token to return with each token's logprob; None: no logprobs."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token to compute with its logprob; None: none."""
        return self.prompt_logprobs

    def sampling_params(
        self, max_tokens: int, choice: int = 0, defaults: Mapping[str, Any] = MappingProxyType({})
    ) -> SamplingParams:
        """The engine's parameters for ``choice`` (choice ``i`` of a seeded request uses seed + i),
        ``defaults`` (the model's generation config's) where the request leaves a field unset.

        Raises ``ValueError`` naming the field when the engine refuses a value.
        """
        seed = choice_seed(self.seed, choice)

        def given(name: str, neutral: Any) -> Any:  # noqa: ANN401
            value = getattr(self, name)
            return defaults.get(name, neutral) if value is None else value

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=given("temperature", 1.0),
            top_p=given("top_p", 1.0),
            top_k=given("top_k", 0),
            min_p=given("min_p", 0.0),
            seed=seed,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            skip_special_tokens=self.skip_special_tokens is not False,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            min_tokens=self.min_tokens or 0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=given("repetition_penalty", 1.0),
            logit_bias={int(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            logprobs=self.num_logprobs,
            prompt_logprobs=self.num_prompt_logprobs,
            **self.guide(),
        )


class CompletionRequest(GenerationFields):
    """``POST /v1/completions``: continue raw prompts (no chat template)."""

    prompt: list[str | list[int]]  # a string, a list of strings, token ids or token-id lists
    # each token's logprob and this many most likely tokens' (legacy completions' format)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # start each choice's text (and its logprobs, the prompt tokens' included) with the prompt
    echo: bool | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: score the prompt, generate none
    suffix: Any = None
    best_of: Any = None
    NEUTRAL = {
        **GenerationFields.NEUTRAL,
        "suffix": (None, ""),
        "best_of": (None, 1),
    }

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_as_list(cls, value: Any) -> Any:
        if isinstance(value, str) or (is_token_ids(value) and value):
            return [value]
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        if isinstance(value, list) and all(isinstance(p, str) or is_token_ids(p) for p in value):
            return value
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        echoed = self.logprobs if self.echo else None
        if echoed is None or self.prompt_logprobs is None:
            return self.prompt_logprobs if echoed is None else echoed
        return max(echoed, self.prompt_logprobs)


class ChatMessage(StrictModel):
    """One turn of a conversation; content parts other than text are refused."""

    role: str  # "system", "user", "assistant", "tool", ...
    content: str | None = None  # the text (a list of text parts is joined); None: empty
    # an assistant's earlier calls, as a response gave them, and a tool message's answer to one
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_joined(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text content parts are supported, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string `text`")
            texts.append(part["text"])
        return "".join(texts)


class ChatTemplateFields(StrictModel):
    """vLLM's extra fields for rendering messages through the chat template."""

    add_generation_prompt: bool | None = None  # open the assistant's turn; None: true
    continue_final_message: bool | None = None  # or leave the final message open; None: false
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    # a Jinja template for this request (vLLM's extra): only on a server started with
    # --trust-request-chat-template
    chat_template: str | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_template_arguments(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(value or {}) & CHAT_TEMPLATE_ARGUMENTS)
        if reserved:
            raise ValueError(f"may not set apply_chat_template's own {', '.join(reserved)}")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _one_way_to_end(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("add_generation_prompt") is not False:
            raise ValueError("needs add_generation_prompt set to false (it opens a new turn)")
        return value

    def chat_options(self) -> ChatOptions:
        return ChatOptions(
            add_generation_prompt=self.add_generation_prompt is not False,
            continue_final_message=bool(self.continue_final_message),
            chat_template_kwargs=self.chat_template_kwargs,
            chat_template=self.chat_template,
        )


class ChatCompletionRequest(GenerationFields, ChatTemplateFields, ToolChoiceRules):
    """``POST /v1/chat/completions``: reply to a conversation, through the chat template."""

    messages: list[ChatMessage]  # the conversation so far, at least one message
    logprobs: bool | None = None  # each token's logprob in choices[].logprobs.content
    # extra (vLLM's): start each reply with the last message's content when it is the reply's
    # role (the final message's with add_generation_prompt false, else an assistant's)
    echo: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and this many alternatives
    # OpenAI's function calling: the functions the model may call, and whether it must: "none"
    # (it answers in text), "required" (one call or more) or {"type": "function", "function":
    # {"name": ...}} (that one); the calls' arguments follow each function's parameters schema
    # (guided decoding). "auto" needs a parser of the model's own tool-call syntax: refused
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        validate_default=True,  # checked when left out too: with tools it means "auto"
    )
    include_reasoning: bool = True  # extra (vLLM's): false drops --reasoning-parser's reasoning

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        named = value.function.name if isinstance(value, NamedToolChoice) else None
        check_tool_choice(value, names, named, guides_given(info.data))
        if names and value != "none" and info.data.get("echo"):
            raise ValueError("cannot be combined with echo: a reply of calls starts afresh")
        return value  # "auto" with tools needs the server's parser: see routes.auto_tools

    def guide_field(self) -> str:
        return "tools" if self.calls_tools else super().guide_field()

    def chat_options(self) -> ChatOptions:
        options = super().chat_options()
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        return dataclasses.replace(options, tools=tools or None)

    def chat_tools(self) -> list[Tool]:
        return self.tools or []

    def guide(self) -> dict[str, Any]:
        if self.calls_tools:
            return {"json_schema": calls_schema(self.tools or [], self.tool_choice)}
        return super().guide()

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("must contain at least one message")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):  # as OpenAI refuses it
            raise ValueError("needs logprobs set to true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        return [template_message(m) for m in self.messages]

    def echoed_text(self) -> str | None:
        """The text each reply starts with under ``echo`` (vLLM's rule); None: nothing."""
        last = self.messages[-1]
        role = "assistant" if self.chat_options().add_generation_prompt else last.role
        return (last.content or "") if self.echo and last.role == role else None


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: text content, and an assistant's earlier calls with
    their arguments as objects where they parse (as transformers' templates expect them)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content or ""}
    if message.tool_calls is not None:
        out["tool_calls"] = [parsed_arguments(call) for call in message.tool_calls]
    for key in ("tool_call_id", "name"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    return out


def is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )
