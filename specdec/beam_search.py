"""Beam search on the engine: vLLM's ``LLM.beam_search``, and the search behind
``specdec.wrap(model).generate(num_beams=...)``, both by transformers' rules.

Each step asks the engine for the next-token logits of every live beam
(``SamplingParams(max_tokens=1, return_logits=True)``). A beam's tokens so far are its prompt for
that step, so the prefix cache serves every full block it shares with the step before: each step
computes only the last partial block of each beam. The search itself runs here, on those rows:

- A row becomes log-probabilities (``log_softmax`` in float32), then, where the caller gives a
  ``process`` rule, transformers' logits processors change them (``min_new_tokens``,
  ``no_repeat_ngram_size``, ...: see :func:`specdec.generate_semantics.processed_row`); each
  beam's row plus its summed score gives its extensions' scores.
- The ``(1 + number of end-of-sequence ids) * width`` best extensions over all beams (at least
  ``2 * width``) are the step's candidates, best first. A candidate that ends (an
  end-of-sequence token, or the last token ``max_tokens`` allows) is *complete*; it joins the
  prompt's completed hypotheses only if it ranks among the best ``width`` candidates, and those
  keep the ``width`` best by ``score / length ** length_penalty``. The best ``width`` candidates
  that do not end are the next step's beams.
- A prompt's search stops changing (transformers' ``early_stopping``): with ``True``, once
  ``width`` hypotheses are complete; with ``False`` (the default) or ``"never"``, once they are
  and the best live beam, scored at its current length (``"never"`` with a positive
  ``length_penalty``: at ``max_tokens``), cannot beat the worst of them. The search ends when
  every prompt's has stopped, or at ``max_tokens``.

This is transformers' ``_beam_search`` for greedy beams, in the order it decides things, so
that ``wrap`` returns its sequences, scores and ``beam_indices``; the prompts of a batch are
searched independently, as there, and a prompt whose search has stopped runs no more steps unless
the caller records every step's rows (transformers' ``scores`` and ``logits`` cover every beam of
every step until the whole batch ends) or samples (transformers draws for every prompt at every
step from torch's global generator, and so does this search, prompt by prompt in the same order,
so that a seed set with ``torch.manual_seed`` draws the same candidates).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specdec.config import SamplingParams

if TYPE_CHECKING:
    from specdec.llm import LLM
    from specdec.lora import LoRARequest

MAX_BEAM_WIDTH = 10  # vLLM's and transformers' common use; each beam is a request per step

# (log-probabilities [V], the prompt, the beam's tokens so far) -> the row the search ranks
RowRule = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


def check_early_stopping(value: object) -> None:
    if not (value is True or value is False or value == "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {value!r}")


@dataclass(slots=True)
class BeamSearchParams:
    """How :meth:`specdec.LLM.beam_search` searches (vLLM's ``BeamSearchParams``, and
    transformers' ``early_stopping``)."""

    beam_width: int  # beams kept per step, and sequences returned per prompt
    max_tokens: int  # most tokens per beam
    ignore_eos: bool = False  # an end-of-sequence token does not complete a beam
    # > 0: beams ranked by the log-probabilities of logits / temperature (as vLLM's V0 engine
    # scored them); 0 (the default) or 1: by the model's own
    temperature: float = 0.0
    length_penalty: float = 1.0  # a beam's score: logprob sum / length ** length_penalty
    # a beam that an end-of-sequence token completed keeps that token's text in `text`
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False  # when a prompt's search stops (see the module doc)

    def __post_init__(self) -> None:
        if not (isinstance(self.beam_width, int) and 1 <= self.beam_width <= MAX_BEAM_WIDTH):
            raise ValueError(
                f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}"
            )
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        check_early_stopping(self.early_stopping)
        t = self.temperature
        if not (isinstance(t, int | float) and not isinstance(t, bool) and 0 <= t < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")


@dataclass(slots=True)
class Beam:
    """One hypothesis: the tokens after the prompt and their summed log-probability."""

    token_ids: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0  # a float32 value, as transformers sums them
    finished: bool = False  # ended by an end-of-sequence token (the last of token_ids)
    text: str = ""  # token_ids decoded (special tokens skipped), set when returned
    # for each token, the slot (prompt index * width + rank among the step's beams) of the beam
    # it extended: transformers' ``beam_indices``
    slots: list[int] = field(default_factory=list)
    # the score it was ranked by when it completed: cum_logprob / length ** length_penalty,
    # in float32
    normalized: float = 0.0


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's ``beam_width`` best beams, best first."""

    prompt_token_ids: list[int]
    sequences: list[Beam]


@dataclass(slots=True)
class Search:
    """What to search for: transformers' beam-search settings, in the engine's terms."""

    width: int
    max_tokens: int
    eos: tuple[int, ...]  # ids that complete a beam (none: only max_tokens does)
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    temperature: float = 0.0  # > 0: rank by the log-probabilities of logits / temperature
    process: RowRule | None = None  # transformers' logits processors, on log-probabilities
    sample: bool = False  # draw the candidates (transformers' beam sampling) instead of the best
    # (prompt, a candidate's tokens) -> whether it completes there anyway (transformers'
    # stopping criteria, max_time among them)
    stops: Callable[[list[int], list[int]], bool] | None = None
    record: bool = False  # keep every step's rows for every beam (transformers' scores/logits)


@dataclass(slots=True)
class SearchResult:
    """Each prompt's completed hypotheses (best first, at most ``width``) and, when recorded,
    every step's ``[prompts * width, V]`` raw logits and ranked rows, by beam slot."""

    completed: list[list[Beam]]
    logits: list[torch.Tensor] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)


def beam_search(
    llm: LLM, prompts: list[list[int]], params: BeamSearchParams, lora: LoRARequest | None = None
) -> list[BeamSearchOutput]:
    """``LLM.beam_search``: every prompt's ``beam_width`` best continuations, best first (through
    the LoRA adapter ``lora`` where given)."""
    eos = () if params.ignore_eos else tuple(llm.engine.eos_token_ids)
    search = Search(
        params.beam_width,
        params.max_tokens,
        eos,
        params.length_penalty,
        params.early_stopping,
        params.temperature,
    )
    detokenizer = llm.engine.detokenizer
    results = []
    for prompt, beams in zip(prompts, run(llm, prompts, search, lora).completed):
        for beam in beams:  # a completing end-of-sequence token's text only where asked for
            body = beam.token_ids[:-1] if beam.finished else beam.token_ids
            beam.text = detokenizer.decode(body)
            if beam.finished and params.include_stop_str_in_output:
                beam.text += detokenizer.decode(beam.token_ids[-1:], skip_special_tokens=False)
        results.append(BeamSearchOutput(prompt, beams))
    return results


def step_params() -> SamplingParams:
    """What each beam asks the engine for: its next-token logits, and nothing drawn (seeded:
    a request draws no seed from torch's global generator, which beam sampling reads)."""
    return SamplingParams(
        max_tokens=1, temperature=0, ignore_eos=True, return_logits=True, seed=0, detokenize=False
    )


def run(
    llm: LLM, prompts: list[list[int]], search: Search, lora: LoRARequest | None = None
) -> SearchResult:
    """Search every prompt's beams, the live beams of all prompts in one engine batch a step."""
    searcher = BeamSearcher(prompts, search)
    while requests := searcher.requests():
        outputs = llm.generate(requests, step_params(), lora_request=lora)
        searcher.advance(torch.cat([out.logits for out in outputs if out.logits is not None]))
    return searcher.result


class BeamSearcher:
    """The search, one step at a time, for any caller that runs the model: :meth:`requests` are
    the token lists whose next-token logits the next step needs (none once the search is over),
    :meth:`advance` takes those logits, in that order. :func:`run` drives it through
    ``LLM.generate``; the server through its engine thread (specdec/serving/beams.py)."""

    def __init__(self, prompts: list[list[int]], search: Search):
        self.prompts, self.search = prompts, search
        self.live: list[list[Beam]] = [[Beam()] for _ in prompts]
        self.result = SearchResult([[] for _ in prompts])
        self.improvable = [True] * len(prompts)  # transformers' early-stop heuristic, not yet met
        self.stopped = [False] * len(prompts)  # no later step changes this prompt's hypotheses
        self.step = 0
        self.queued: list[tuple[int, Beam]] = []  # the beams of the requests handed out

    def requests(self) -> list[list[int]]:
        """The next step's beams, as prompts (empty: the search is over)."""
        search = self.search
        self.queued = []
        if self.step < search.max_tokens and not all(self.stopped):
            self.queued = [
                (i, beam)
                for i, beams in enumerate(self.live)
                if search.record or search.sample or not self.stopped[i]
                for beam in beams
            ]
        return [self.prompts[i] + beam.token_ids for i, beam in self.queued]

    def advance(self, logits: torch.Tensor) -> None:
        """One step, from the raw next-token logits of :meth:`requests`' beams, ``[n, V]``."""
        search, queued, width = self.search, self.queued, self.search.width
        logits = logits.float()
        scaled = logits / search.temperature if search.temperature > 0 else logits
        rows = torch.log_softmax(scaled, dim=-1)
        if search.process is not None:
            rows = torch.stack(
                [search.process(row, self.prompts[i], beam.token_ids) for row, (i, beam) in
                 zip(rows, queued)]
            )  # fmt: skip
        if search.record:
            self.result.logits.append(_by_slot(logits, queued, len(self.prompts), width))
            self.result.scores.append(_by_slot(rows, queued, len(self.prompts), width))
        start = 0
        for i in sorted({i for i, _ in queued}):
            n = len(self.live[i])
            self.live[i] = _extend(
                search,
                i,
                self.prompts[i],
                self.live[i],
                rows[start : start + n],
                self.result.completed[i],
                self.stopped[i],
            )
            start += n
            if self.improvable[i]:
                self.improvable[i] = _improvable(
                    search, self.live[i], self.result.completed[i], self.step + 1
                )
            full = len(self.result.completed[i]) == width
            # (no live beam: every candidate completed, by a stopping criterion)
            stopped = not self.improvable[i] or (search.early_stopping is True and full)
            self.stopped[i] = stopped or not self.live[i]
        self.step += 1


def _extend(
    search: Search,
    i: int,
    prompt: list[int],
    beams: list[Beam],
    rows: torch.Tensor,  # [len(beams), V] the rows the search ranks
    completed: list[Beam],  # the prompt's completed hypotheses, best first (updated in place)
    stopped: bool,
) -> list[Beam]:
    """One step of prompt ``i``'s search: its next beams."""
    width, vocab = search.width, rows.shape[1]
    keep = max(2, 1 + len(search.eos)) * width
    cum = torch.tensor([beam.cum_logprob for beam in beams], dtype=torch.float32)
    totals = rows + cum[:, None]
    if search.sample:
        scores, flat = _draw(totals, width, keep)
    else:
        scores, flat = torch.topk(totals.flatten(), min(keep, rows.numel()))
    length = len(beams[0].token_ids) + 1
    normalized = (scores / length**search.length_penalty).tolist()
    ended: list[Beam] = []
    following: list[Beam] = []
    for rank, (score, index, norm) in enumerate(zip(scores.tolist(), flat.tolist(), normalized)):
        parent, token = divmod(index, vocab)
        beam = beams[parent]
        extended = Beam(
            [*beam.token_ids, token],
            score,
            token in search.eos,
            slots=[*beam.slots, i * width + parent],
            normalized=norm,
        )
        ends = extended.finished or length >= search.max_tokens
        if not ends and search.stops is not None:
            ends = search.stops(prompt, extended.token_ids)
        if ends:
            if rank < width and not stopped:  # only the best `width` candidates may complete
                ended.append(extended)
        elif len(following) < width:
            following.append(extended)
    if ended:  # the best `width` of those completed before and now (earlier ones first on ties)
        merged = sorted(completed + ended, key=lambda b: b.normalized, reverse=True)
        completed[:] = merged[:width]
    return following


def _draw(totals: torch.Tensor, width: int, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Beam sampling's candidates: ``keep`` extensions drawn without replacement, each with
    probability proportional to ``exp(total)`` over every beam's row, best first. As
    transformers draws them, from torch's global generator, over ``width`` rows: at the first
    step the one beam is there ``width`` times, the copies with 1e9 less, never drawn."""
    if len(totals) < width:
        copies = totals[:1] + torch.tensor(-1e9, dtype=torch.float32)
        totals = torch.cat([totals, copies.expand(width - len(totals), -1)])
    flat = totals.flatten()
    drawn = torch.multinomial(torch.softmax(flat, dim=-1), num_samples=keep)
    scores, order = flat[drawn].sort(descending=True)
    return scores, drawn[order]


def _improvable(search: Search, live: list[Beam], completed: list[Beam], length: int) -> bool:
    """Whether the best live beam may still beat the worst of ``width`` completed hypotheses
    (transformers' heuristic: the live beam scored at ``length``, or at ``max_tokens`` for
    ``early_stopping="never"`` with a positive ``length_penalty``)."""
    if len(completed) < search.width:
        return True
    if not live:
        return False
    if search.early_stopping == "never" and search.length_penalty > 0:
        length = search.max_tokens
    best = torch.tensor(live[0].cum_logprob, dtype=torch.float32) / length**search.length_penalty
    return bool(best > min(beam.normalized for beam in completed))


def _by_slot(
    rows: torch.Tensor, queued: list[tuple[int, Beam]], prompts: int, width: int
) -> torch.Tensor:
    """A step's rows as transformers holds them: ``[prompts * width, V]``, prompt ``i``'s beams
    at ``i * width`` on, best first. At the first step each prompt has one beam, which
    transformers runs ``width`` times over."""
    out = torch.zeros(prompts * width, rows.shape[1])
    seen: dict[int, int] = {}
    for row, (i, _) in zip(rows, queued):
        seen[i] = seen.get(i, 0) + 1
        out[i * width + seen[i] - 1] = row
    for i, n in seen.items():
        if n == 1:
            out[i * width + 1 : (i + 1) * width] = out[i * width]
    return out
