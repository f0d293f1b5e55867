"""User-facing configuration: how to sample a request (the engine's sizing is
:mod:`specdec.engine_config`).

:class:`SamplingParams` is a dataclass validated on construction, so a bad value fails where
it is written with a ``ValueError`` that names the field, not deep inside a forward pass (vLLM's
``StructuredOutputsParams``, which it takes, is :mod:`specdec.structured.params`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from specdec.structured.params import GUIDES, StructuredOutputsParams, check_guides

# Temperatures below this decode greedily, as in vLLM: at 1e-38 and below, logits / temperature
# overflows float32 and the distribution becomes NaN, and long before that it is one-hot anyway.
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # most alternatives per token that logprobs returns (OpenAI's and vLLM's cap)


@dataclass(slots=True)
class SamplingParams:
    """How one request is decoded (the fields and defaults of vLLM's ``SamplingParams``)."""

    max_tokens: int = 16  # most tokens to generate
    min_tokens: int = 0  # tokens to generate before EOS or a stop token id may end the request
    temperature: float = 1.0  # 0 (or below MIN_SAMPLING_TEMPERATURE) means greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens with this much mass; 1 disables
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 disables
    min_p: float = 0.0  # keep tokens with at least min_p x the top probability; 0 disables
    # transformers' warpers after min_p (specdec.wrap passes them on; see specdec.sampling):
    typical_p: float = 1.0  # locally typical sampling's mass (Meister et al. 2022); 1 disables
    epsilon_cutoff: float = 0.0  # drop tokens below this probability (Hewitt et al. 2022)
    eta_cutoff: float = 0.0  # drop below min(eta, sqrt(eta) e^-entropy) (Hewitt et al. 2022)
    seed: int | None = None  # per-request generator seed: reproducible whatever else runs
    stop: list[str] = field(default_factory=list)  # stop strings, excluded from the output
    # transformers' stop strings: the output ends with (and keeps) the token completing one
    stop_strings: list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end generation
    ignore_eos: bool = False  # keep generating past the end-of-sequence token
    # vLLM's penalties, applied to the raw logits before temperature: repetition divides a
    # positive logit (multiplies a negative one) of every token in the prompt or the output by
    # it (Keskar et al. 2019, CTRL; transformers' rule); presence subtracts itself from the
    # logit of every token in the output, frequency itself times the token's count there
    presence_penalty: float = 0.0  # in [-2, 2]; 0 disables
    frequency_penalty: float = 0.0  # in [-2, 2]; 0 disables
    repetition_penalty: float = 1.0  # > 0; 1 disables, above 1 discourages repeats
    # added to these token ids' raw logits before anything else (OpenAI's logit_bias; values in
    # [-100, 100]: -100 bans a token, 100 all but forces it)
    logit_bias: dict[int, float] | None = None
    num_speculative_tokens: int | None = None  # cap on drafts per step; 0 turns speculation off
    return_logits: bool = False  # hand back each generated token's raw logits (RequestOutput)
    # hand back the hidden states of every token fed (the prompt's, then each output token's but
    # the last), after the embedding and after each decoder layer, the last after the final norm
    # (transformers' output_hidden_states); see RequestOutput.hidden_states. A request that asks
    # is not served from the prefix cache, whose positions compute nothing
    return_hidden_states: bool = False
    # hand back, for the same positions, each layer's attention probabilities over the
    # positions before and at it (transformers' output_attentions); see RequestOutput.attentions
    return_attentions: bool = False
    # hand back each generated token's log-probability and the logprobs most likely tokens'
    # (0: the chosen token's alone; None: none), from the model's raw distribution, before
    # temperature or top-k/p (vLLM's default); see RequestOutput.logprobs
    logprobs: int | None = None
    # hand back each prompt token's log-probability given the tokens before it, and the
    # prompt_logprobs most likely tokens' there (vLLM's option; the first token has none); a
    # request that asks is not served from the prefix cache, whose positions compute nothing
    prompt_logprobs: int | None = None
    # the output must be one of these strings, spelled as the tokenizer spells it alone, then
    # end (vLLM's guided choice); other tokens get -inf logits before sampling
    choice: list[str] | None = None
    # the output must match this regular expression in full, then end (vLLM's guided regex;
    # the syntax: specdec/structured/regex.py)
    regex: str | None = None
    # the output must be a JSON document this JSON Schema accepts (a dict or its JSON text),
    # then end (vLLM's guided json; the keywords: specdec/structured/json_schema.py)
    json_schema: dict[str, Any] | str | None = None
    # the output must be a string this grammar derives, then end (vLLM's guided grammar: EBNF
    # "root ::= ..." or Lark "start: ..."; any nesting: specdec/structured/grammar.py)
    grammar: str | None = None
    # free text with tagged structures (tool calls) in it: vLLM's structural tag, its JSON text
    # or the object (the formats: specdec/structured/structural_tag.py)
    structural_tag: str | dict[str, Any] | None = None
    # vLLM's form of the five above (see StructuredOutputsParams)
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # its name before vLLM 0.11
    # the guide above applies after this text first ends the output (a reasoning model's
    # "</think>": vLLM's reasoning-aware structured outputs); before it the output is free
    guide_after: str | None = None
    # with guide_after: the free part must open with this text (a reasoning model's "<think>");
    # an output that does not open with it is guided from its first token
    guide_after_opening: str | None = None
    # completions per prompt in LLM.generate (vLLM's n); completion i uses seed + i, if seeded
    n: int = 1
    skip_special_tokens: bool = True  # leave special tokens (end of turn, EOS) out of the text
    # decode the output into text (vLLM's); False: tokens only, the text stays empty (no stop
    # strings then, which are looked for in the text)
    detokenize: bool = True
    include_stop_str_in_output: bool = False  # end the text after the stop string, not before
    # only these token ids may be generated (vLLM's allowed_token_ids): every other token gets a
    # -inf logit, end-of-sequence ids included unless listed; None: any token
    allowed_token_ids: list[int] | None = None
    # words never generated (vLLM's bad_words): each word's tokens, spelled alone and (see
    # Engine.add_request) after a space; its last token gets -inf where the output ends with the
    # ones before it
    bad_words: list[str] | None = None
    # transformers' generate rules (specdec.wrap passes them on), over the prompt and the output:
    suppress_tokens: list[int] | None = None  # token ids never generated
    begin_suppress_tokens: list[int] | None = None  # token ids never generated first
    bad_words_ids: list[list[int]] | None = None  # token sequences never completed
    no_repeat_ngram_size: int = 0  # no n-gram of this many tokens occurs twice; 0 disables
    # {token ids: bias}, or [[token ids, bias], ...]: the bias is added to the raw logit of a
    # sequence's last token where the tokens before it end the context (one token: everywhere),
    # before the penalties (specdec.token_rules.sequence_bias_row)
    sequence_bias: dict[tuple[int, ...], float] | None = None
    # transformers' forcing rules: one token allowed (logit 0) first where the prompt is one
    # token (forced_bos_token_id), and last, at max_tokens (forced_eos_token_id: id or ids)
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | list[int] | None = None
    # (start, factor): past `start` generated tokens, an end-of-sequence id's logit x gains
    # |x| * (factor ** (generated - start) - 1) (transformers' ExponentialDecayLengthPenalty)
    exponential_decay_length_penalty: tuple[int, float] | None = None
    # vLLM's (v0) logits processors, called on every row the next token is decided from (drafts'
    # rows too), after the rules above and before a guide: fn(output_token_ids, logits) or
    # fn(prompt_token_ids, output_token_ids, logits) -> logits (see token_rules), pure functions
    logits_processors: list[Callable[..., Any]] | None = None
    # keep only the prompt's last k tokens (vLLM's left truncation; -1: as many as the context
    # holds with room for one new token); None: a prompt too long for the context is refused
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # vLLM's defaults for these are None
        self.stop = [] if self.stop is None else self.stop
        self.stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        _check(
            isinstance(self.stop, list | tuple) and isinstance(self.stop_token_ids, list | tuple),
            f"stop and stop_token_ids must be lists, got {self.stop!r} and {self.stop_token_ids!r}",
        )
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        structured = self.structured_outputs or self.guided_decoding
        if structured is not None:
            given = "structured_outputs" if self.structured_outputs else "guided_decoding"
            flat = [n for n in GUIDES if getattr(self, n) is not None]
            flat += ["guided_decoding"] if self.structured_outputs and self.guided_decoding else []
            _check(not flat, f"give {given} or {flat[0] if flat else ''}, not both")
            for name, value in structured.guide().items():
                setattr(self, name, value)
        _check(
            isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool),
            f"max_tokens must be an integer, got {self.max_tokens!r}",
        )
        _check(self.max_tokens > 0, f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
            f"got {self.min_tokens!r}",
        )
        _check(
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature),
            f"temperature must be a finite number, got {self.temperature!r}",
        )
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < MIN_SAMPLING_TEMPERATURE:
            self.temperature = 0.0
        _check(
            _is_number(self.top_p) and 0 < self.top_p <= 1,
            f"top_p must be a number in (0, 1], got {self.top_p!r}",
        )
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}",
        )
        _check(
            _is_number(self.min_p) and 0 <= self.min_p <= 1,
            f"min_p must be a number in [0, 1], got {self.min_p!r}",
        )
        _check(
            _is_number(self.typical_p) and 0 < self.typical_p <= 1,
            f"typical_p must be a number in (0, 1], got {self.typical_p!r}",
        )
        for name in ("epsilon_cutoff", "eta_cutoff"):
            value = getattr(self, name)
            _check(_is_number(value) and 0 <= value < 1, f"{name} must be in [0, 1), got {value!r}")
        for name in (
            "ignore_eos",
            "return_logits",
            "return_hidden_states",
            "return_attentions",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "detokenize",
        ):
            _check(
                isinstance(getattr(self, name), bool),
                f"{name} must be true or false, got {getattr(self, name)!r}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and -2 <= value <= 2,
                f"{name} must be a number in [-2, 2], got {value!r}",
            )
        _check(
            self.logit_bias is None
            or (
                isinstance(self.logit_bias, dict)
                and all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0
                    for t in self.logit_bias
                )
                and all(
                    isinstance(b, (int, float)) and not isinstance(b, bool) and -100 <= b <= 100
                    for b in self.logit_bias.values()
                )
            ),
            "logit_bias must map non-negative token ids to numbers in [-100, 100], got "
            f"{self.logit_bias!r}",
        )
        self._check_token_rules()
        _check(
            isinstance(self.repetition_penalty, (int, float))
            and not isinstance(self.repetition_penalty, bool)
            and 0 < self.repetition_penalty < math.inf,
            f"repetition_penalty must be a positive number, got {self.repetition_penalty!r}",
        )
        _check(
            self.seed is None or isinstance(self.seed, int),
            f"seed must be an integer or None, got {self.seed!r}",
        )
        _check(
            isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1,
            f"n must be a positive integer, got {self.n!r}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop must be non-empty strings, got {self.stop!r}",
        )
        _check(
            self.num_speculative_tokens is None
            or (isinstance(self.num_speculative_tokens, int) and self.num_speculative_tokens >= 0),
            f"num_speculative_tokens must be a non-negative integer, got "
            f"{self.num_speculative_tokens!r}",
        )
        check_guides(self)  # the guides (GUIDES) and guide_after
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None
                or (
                    isinstance(value, int)
                    and not isinstance(value, bool)
                    and 0 <= value <= MAX_LOGPROBS
                ),
                f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}",
            )
        if isinstance(self.stop_strings, str):
            self.stop_strings = [self.stop_strings]
        strings = self.stop_strings
        _check(
            strings is None
            or (
                isinstance(strings, list | tuple) and all(isinstance(t, str) and t for t in strings)
            ),
            f"stop_strings must be a list of non-empty strings, got {strings!r}",
        )
        _check(
            self.detokenize is not False or not (strings or self.stop),
            "stop strings are looked for in the text: they need detokenize=True",
        )
        _check(
            not (strings and self.stop),
            "give stop (vLLM's: cut from the text) or stop_strings (transformers': kept), not both",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}",
        )

    def _check_token_rules(self) -> None:
        """The token lists and rules (allowed, bad words, transformers' rules, truncation)."""
        allowed, words, ids = self.allowed_token_ids, self.bad_words, self.bad_words_ids
        n, k, begin = (
            self.no_repeat_ngram_size,
            self.truncate_prompt_tokens,
            self.begin_suppress_tokens,
        )
        bias = self.sequence_bias
        pairs = list(bias.items()) if isinstance(bias, dict) else bias
        bos, eos = self.forced_bos_token_id, self.forced_eos_token_id
        decay = self.exponential_decay_length_penalty
        for name, ok, rule in (
            ("allowed_token_ids", allowed is None or (_token_ids(allowed) and len(allowed) > 0),
             "a non-empty list of non-negative token ids"),
            ("bad_words", words is None or (isinstance(words, list | tuple)
                                            and all(isinstance(w, str) and w.strip() for w in words)),
             "a list of non-blank strings"),
            ("suppress_tokens", self.suppress_tokens is None or _token_ids(self.suppress_tokens),
             "a list of non-negative token ids"),
            ("bad_words_ids", ids is None or (isinstance(ids, list | tuple)
                                              and all(_token_ids(w) and len(w) > 0 for w in ids)),
             "a list of non-empty lists of non-negative token ids"),
            ("no_repeat_ngram_size", _is_int(n) and n >= 0, "a non-negative integer"),
            ("begin_suppress_tokens", begin is None or _token_ids(begin),
             "a list of non-negative token ids"),
            ("sequence_bias", bias is None or (isinstance(pairs, list | tuple) and all(
                isinstance(pair, list | tuple) and len(pair) == 2 and _token_ids(pair[0])
                and len(pair[0]) > 0 and _is_number(pair[1]) and abs(pair[1]) != float("inf")
                for pair in pairs)),
             "{token ids tuple: bias} or [[token ids, bias], ...], biases finite numbers"),
            ("truncate_prompt_tokens", k is None or (_is_int(k) and (k == -1 or k >= 1)),
             "-1 (as many as fit) or a positive integer"),
            ("forced_bos_token_id", bos is None or (_is_int(bos) and bos >= 0),
             "None or a non-negative token id"),
            ("forced_eos_token_id", eos is None or (_is_int(eos) and eos >= 0)
             or (isinstance(eos, list | tuple) and len(eos) > 0 and _token_ids(eos)),
             "None, a non-negative token id or a non-empty list of them"),
            ("logits_processors", self.logits_processors is None or (isinstance(
                self.logits_processors, list | tuple) and all(map(callable, self.logits_processors))),
             "a list of callables"),
            ("exponential_decay_length_penalty", decay is None or (
                isinstance(decay, list | tuple) and len(decay) == 2 and _is_int(decay[0])
                and decay[0] >= 0 and _is_number(decay[1]) and 0 < decay[1] < math.inf),
             "None or (start, factor): a non-negative integer and a finite positive number"),
        ):  # fmt: skip
            _check(ok, f"{name} must be {rule}, got {getattr(self, name)!r}")
        if pairs is not None:  # transformers' list form, as the dict it stands for
            self.sequence_bias = {tuple(ids): float(b) for ids, b in pairs}
        if decay is not None:
            self.exponential_decay_length_penalty = (decay[0], float(decay[1]))
        if self.logits_processors is not None:
            self.logits_processors = list(self.logits_processors)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def keeps_layers(self) -> bool:
        """Whether the request keeps per-layer outputs (hidden states or attentions)."""
        return self.return_hidden_states or self.return_attentions

    @property
    def has_generate_rules(self) -> bool:
        """Whether transformers' token rules (see :func:`specdec.token_rules.generate_rule_bans`)
        are on."""
        return bool(self.suppress_tokens or self.bad_words_ids or self.no_repeat_ngram_size)

    @property
    def forced_eos_ids(self) -> list[int]:
        """``forced_eos_token_id`` as a list (empty when None)."""
        eos = self.forced_eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @property
    def has_position_rules(self) -> bool:
        """Whether transformers' forcing rules or length decay are on (see
        :func:`specdec.token_rules.apply_position_rules`)."""
        return (
            self.forced_bos_token_id is not None
            or self.forced_eos_token_id is not None
            or self.exponential_decay_length_penalty is not None
        )

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1
        )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: Any) -> bool:
    """Whether ``value`` is a list (or tuple) of non-negative integer token ids."""
    return isinstance(value, list | tuple) and all(_is_int(t) and t >= 0 for t in value)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of completion ``choice`` of a request seeded ``seed`` (vLLM's ``n``): seed +
    choice, in int64's range; unseeded completions draw seeds of their own."""
    return seed if seed is None or choice == 0 else (seed + choice) % 2**63


def _is_number(value: object) -> bool:
    """A real number (an int or float, not a bool), NaN excluded."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value
