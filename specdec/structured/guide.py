"""Guides: which tokens may come next in a guided request (``SamplingParams.choice``, ``regex``,
``json_schema``, ``grammar``, ``structural_tag``).

A guide walks the output token by token from its :meth:`start` state; :meth:`allowed` gives the
tokens that keep the output on a path to a whole match, end-of-sequence ids included where the
output is one already. The verifier gives every other token ``-inf`` in each verification row,
at the state reached through the drafts before that row (specdec/verifier.py), so the output is
the one plain decoding under the same constraint gives, whatever the drafter.

:class:`RegexGuide` indexes the vocabulary against a byte DFA (:mod:`specdec.structured.regex`):
each token's bytes (:func:`token_bytes`) are walked from a state, all tokens at once with numpy,
once per state reached, and the resulting mask is kept, a bit per token (Outlines' index,
built lazily and bounded). Grammars, schemas and structural tags that nest get a
:class:`~specdec.structured.pushdown.PushdownGuide` instead, over one DFA per rule.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from specdec.structured.after import after_text
from specdec.structured.counted import counted
from specdec.structured.grammar import grammar_rules
from specdec.structured.json_schema import schema_rules
from specdec.structured.masks import Masks
from specdec.structured.params import GUIDES
from specdec.structured.pushdown import PushdownGuide
from specdec.structured.regex import DEAD, DFA, TooLarge, compile_tree, counter, parse_regex, shown
from specdec.structured.structural_tag import structural_tag_rules

G = TypeVar("G", bound="RegexGuide | PushdownGuide")
END = -1  # a choice trie's key for "a whole choice ends here"
GUIDE_CACHE = 32  # compiled patterns an engine keeps
MASKS_KEPT = 4096  # token masks a pattern keeps (25 MB at SmolLM2's vocabulary)


class Guide(Protocol):
    def start(self) -> Any: ...

    def advance(self, state: Any, token: int) -> Any | None:
        """The state after ``token``, or None where the output has left every match."""

    def allowed(self, state: Any) -> list[int] | torch.Tensor:
        """The tokens that may follow: ids, or a [V] bool mask."""


class ChoiceGuide:
    """The output is one of a few strings, each spelled as the tokenizer spells it alone: the
    choices' token ids as a trie (token id -> subtree; the key :data:`END` marks where a choice
    is complete)."""

    def __init__(self, choices: list[str], tokenizer: Any, eos_token_ids: tuple[int, ...]):
        self.trie: dict[int, dict] = {}
        self.eos_token_ids = list(eos_token_ids)
        for text in choices:
            node = self.trie
            for token in tokenizer.encode(text, add_special_tokens=False):
                node = node.setdefault(token, {})
            node[END] = {}

    def start(self) -> dict[int, dict]:
        return self.trie

    def advance(self, state: dict[int, dict], token: int) -> dict[int, dict] | None:
        return state.get(token)

    def allowed(self, state: dict[int, dict]) -> list[int]:
        return [t for t in state if t != END] + (self.eos_token_ids if END in state else [])


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """Each token id's bytes in the text, ``b""`` for special tokens and ids the tokenizer lacks.

    Byte-level BPE vocabularies (GPT-2's, SmolLM2's) spell each byte as one printable character;
    SentencePiece ones write a space as ``▁`` and bytes with no piece of their own as ``<0xNN>``.
    """
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    byte_of = _byte_level_alphabet()
    ordinary = [p for i, p in enumerate(pieces) if i not in special and p]
    byte_level = all(c in byte_of for p in ordinary for c in p)
    out = []
    for i, piece in enumerate(pieces):
        if i in special or not piece:
            out.append(b"")
        elif byte_level:
            out.append(bytes(byte_of[c] for c in piece))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("▁", " ").encode())
    return out + [b""] * (vocab_size - len(out))


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the code points from 256 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    pairs = [(chr(b), b) for b in printable] + [(chr(256 + n), b) for n, b in enumerate(others)]
    return dict(pairs)


class Vocabulary:
    """A tokenizer's token bytes laid out for walking every token through a DFA at once: the
    tokens with any bytes, longest first, their bytes a row per position (a walk reads byte k of
    every token still reading from one contiguous row)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        spelled = token_bytes(tokenizer, vocab_size)
        for eos in eos_token_ids:  # an end-of-sequence id ends the output, whatever it spells
            spelled[eos] = b""
        self.spelled, self.size = spelled, vocab_size
        self.eos_token_ids = list(eos_token_ids)
        ids = [i for i, b in enumerate(spelled) if b]
        ids.sort(key=lambda i: -len(spelled[i]))
        self.ids = np.array(ids, np.int64)
        self.lengths = np.array([len(spelled[i]) for i in ids], np.int64)
        longest = int(self.lengths[0]) if ids else 0
        matrix = np.zeros((len(ids), longest), np.uint8)
        for row, i in enumerate(ids):
            matrix[row, : len(spelled[i])] = np.frombuffer(spelled[i], np.uint8)
        self.columns = np.ascontiguousarray(matrix.T)  # [longest, T]: row k, each token's byte k
        # how many tokens are longer than k bytes, for k = 0 .. longest - 1
        self.longer = [int((self.lengths > k).sum()) for k in range(longest)]
        # [V] bool: the tokens that spell nothing and do not end the output (special tokens),
        # which free text before a guide's text allows
        self.unspelled = torch.tensor([not b for b in spelled], dtype=torch.bool)
        self.unspelled[self.eos_token_ids] = False


class RegexGuide:
    """The output matches a regular expression in full (then ends)."""

    def __init__(self, dfa: DFA, vocabulary: Vocabulary):
        self.dfa, self.vocabulary = dfa, vocabulary
        self.masks = Masks(vocabulary.size, MASKS_KEPT)

    def start(self) -> int:
        return self.dfa.start

    def advance(self, state: int, token: int) -> int | None:
        spelled = self.vocabulary.spelled[token] if token < self.vocabulary.size else b""
        if not spelled:  # an end-of-sequence id ends the output; other specials never match
            return None
        state = self.dfa.walk(state, spelled)
        return None if state == DEAD else state

    def allowed(self, state: int) -> torch.Tensor:
        return self.masks.get(state, self._mask)

    def _mask(self, state: int) -> np.ndarray:
        v, table = self.vocabulary, self.dfa.table
        at = np.full(len(v.ids), state, np.int32)
        for k, count in enumerate(v.longer):  # the tokens longer than k bytes read byte k
            at[:count] = table[at[:count], v.columns[k, :count]]
        mask = np.zeros(v.size, bool)
        mask[v.ids[at != DEAD]] = True
        accepting = bool(self.dfa.accepting[state])
        if accepting or not mask.any():  # a whole match may end; a dead end ends, not stalls
            mask[v.eos_token_ids] = True
        return mask


class AfterTextGuide(RegexGuide):
    """A :class:`RegexGuide` over :func:`~specdec.structured.after.after_text`'s DFA: in its
    free states (before the text) the output is free, special tokens included: a token that
    spells nothing (but an end-of-sequence id, which ends the output) is allowed there and
    leaves the state as it is."""

    def __init__(self, dfa: DFA, vocabulary: Vocabulary, free: np.ndarray):
        super().__init__(dfa, vocabulary)
        self.free, self.unspelled = free, vocabulary.unspelled  # [S] bool, [V] bool

    def advance(self, state: int, token: int) -> int | None:
        if self.free[state] and bool(self.unspelled[token]):
            return state
        return super().advance(state, token)

    def allowed(self, state: int) -> torch.Tensor:
        mask = super().allowed(state)
        return mask | self.unspelled if self.free[state] else mask


class GuideFactory:
    """An engine's guides: compiled patterns kept (least recently used out) across requests."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._vocabulary: Vocabulary | None = None
        self._cache: OrderedDict[str, RegexGuide | PushdownGuide] = OrderedDict()
        self._lock = threading.Lock()

    def for_params(self, params: Any) -> Guide | None:
        """The guide of a request's ``SamplingParams`` (None if unguided); ValueError for a
        pattern or schema this engine cannot follow."""
        if all(getattr(params, name) is None for name in GUIDES):
            return None
        if not self.eos_token_ids or self.tokenizer is None:
            raise ValueError(
                "guided decoding needs the model's tokenizer and end-of-sequence token"
            )
        after = (params.guide_after, params.guide_after_opening or "")
        if params.choice is not None and after[0] is None:
            return ChoiceGuide(params.choice, self.tokenizer, self.eos_token_ids)
        if params.choice is not None:  # after a text, the choices' bytes, however tokenized
            return self._regex("|".join(re.escape(c) for c in params.choice), after)
        if params.regex is not None:
            return self._regex(params.regex, after)
        if params.grammar is not None:
            text = params.grammar
            return self._rules(f"grammar\0{text}", lambda: _parsed(grammar_rules(text)), after)
        if params.structural_tag is not None:
            spec = params.structural_tag
            key = spec if isinstance(spec, str) else json.dumps(spec)
            try:
                return self._rules(
                    f"structural_tag\0{key}", lambda: structural_tag_rules(spec), after
                )
            except TooLarge as e:
                raise ValueError(f"structural_tag: too large: {e}") from None
        schema = params.json_schema
        key = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        return self._rules(f"json\0{key}", lambda: _parsed(schema_rules(schema)), after)

    def _rules(
        self,
        name: str,
        trees: Callable[[], list[tuple]],
        after: tuple[str | None, str],
        label: str | None = None,
    ) -> Guide:
        """The guide of the syntax trees ``trees()`` gives, the first the whole output's, the
        others rules it calls (a grammar's, a schema's, a structural tag's; repetitions with
        large counts become rules too, :func:`~specdec.structured.counted.counted`): the
        first's DFA where there is no other (a :class:`RegexGuide`), else a
        :class:`PushdownGuide` over their DFAs; after a text (``after``, see :meth:`_guide`)
        either way. Kept under ``name``; ``label`` names it in a too-large error."""
        label = label or name.split("\0")[0]
        text, opening = after
        key = name if text is None else f"{opening}\0{text}\0{name}"  # as _guide keeps one
        with self._lock:
            for kept in (key, f"pushdown\0{key}"):
                guide = self._cache.get(kept)
                if guide is not None:
                    self._cache.move_to_end(kept)
                    return guide
        built = counted(trees())
        if len(built) == 1:
            return self._guide(name, lambda: compile_tree(built[0], label), after)
        compiled: dict[str, DFA] = {}  # a grammar's rules repeat (one may be the whole output)
        for tree in built:
            if repr(tree) not in compiled:
                compiled[repr(tree)] = (
                    counter(*tree[1:]) if tree[0] == "count" else compile_tree(tree, label)
                )
        dfas = [compiled[repr(tree)] for tree in built]
        free = None
        if text is not None:
            dfas[0], free = after_text(text.encode(), dfas[0], opening.encode())
        return self._keep_guide(
            f"pushdown\0{key}", PushdownGuide(dfas, self._vocabulary_of(), free)
        )

    def _regex(self, pattern: str, after: tuple[str | None, str] = (None, "")) -> Guide:
        trees = lambda: [parse_regex(pattern)]  # noqa: E731
        return self._rules(pattern, trees, after, f"regex {shown(pattern)}")

    def _guide(
        self, name: str, compile: Callable[[], DFA], after: tuple[str | None, str]
    ) -> RegexGuide:
        """The guide of the DFA ``compile()`` gives, kept under ``name`` (applied after the
        text ``after[0]``, if given, entered through the opening ``after[1]``, if given: see
        :mod:`specdec.structured.after`), compiled once (the server compiles it on a worker
        thread before the engine's thread asks for it: the cache is shared under a lock)."""
        text, opening = after
        key = name if text is None else f"{opening}\0{text}\0{name}"
        with self._lock:
            guide = self._cache.get(key)
            if guide is not None:
                self._cache.move_to_end(key)
                assert isinstance(guide, RegexGuide)
                return guide
        dfa, vocabulary = compile(), self._vocabulary_of()
        if text is None:
            guide = RegexGuide(dfa, vocabulary)
        else:
            joined, free = after_text(text.encode(), dfa, opening.encode())
            guide = AfterTextGuide(joined, vocabulary, free)
        return self._keep_guide(key, guide)

    def _vocabulary_of(self) -> Vocabulary:
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = Vocabulary(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._vocabulary

    def _keep_guide(self, key: str, guide: G) -> G:
        with self._lock:
            self._cache[key] = guide
            if len(self._cache) > GUIDE_CACHE:
                self._cache.popitem(last=False)
        return guide


def _parsed(patterns: tuple[str, ...]) -> list[tuple]:
    """The syntax trees of patterns that call each other (``(?&n)``)."""
    return [parse_regex(p, calls=True) for p in patterns]
