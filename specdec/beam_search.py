"""Beam search on the engine, as vLLM's ``LLM.beam_search`` runs it: each step asks the engine
for one token of every live beam with its ``2 * beam_width`` most likely continuations
(``SamplingParams(max_tokens=1, logprobs=...)``), and keeps the ``beam_width`` best extensions
by summed log-probability. A beam's tokens so far are its prompt for the next step, so the
prefix cache serves every full block it shares with the step before: each step computes only
the last partial block of each beam.

The candidates of a step are the ``2 * beam_width`` most likely tokens of each beam, which hold
the best ``2 * beam_width`` extensions over all beams that transformers takes from the flattened
``beams x vocabulary`` scores. As in transformers, an end-of-sequence candidate ranked among the
best ``beam_width`` completes its beam (unless ``ignore_eos``), and the best ``beam_width``
other candidates go on. The search ends at ``max_tokens``, or once ``beam_width`` beams are
complete and no live beam scores better than the worst of them now (transformers' default
``early_stopping=False`` rule). Beams are ranked by ``sum of logprobs / length **
length_penalty``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.config import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from specdec.llm import LLM


@dataclass(slots=True)
class BeamSearchParams:
    """How :meth:`specdec.LLM.beam_search` searches (vLLM's ``BeamSearchParams``)."""

    beam_width: int  # beams kept per step, and sequences returned per prompt
    max_tokens: int  # most tokens per beam
    ignore_eos: bool = False  # an end-of-sequence token does not complete a beam
    length_penalty: float = 1.0  # a beam's score: logprob sum / length ** length_penalty

    def __post_init__(self) -> None:
        if not (isinstance(self.beam_width, int) and 1 <= self.beam_width <= MAX_LOGPROBS // 2):
            raise ValueError(
                f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], got {self.beam_width!r}"
            )
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")


@dataclass(slots=True)
class Beam:
    """One hypothesis: the tokens after the prompt and their summed log-probability."""

    token_ids: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    finished: bool = False  # ended by an end-of-sequence token (the last of token_ids)
    text: str = ""  # token_ids decoded (special tokens skipped), set when returned

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / max(1, len(self.token_ids)) ** length_penalty


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's ``beam_width`` best beams, best first."""

    prompt_token_ids: list[int]
    sequences: list[Beam]


def beam_search(
    llm: LLM, prompts: list[list[int]], params: BeamSearchParams
) -> list[BeamSearchOutput]:
    """Search every prompt's beams, all prompts' live beams in one engine batch per step."""
    width, eos = params.beam_width, set(llm.engine.eos_token_ids)
    step = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=2 * width)
    live: list[list[Beam]] = [[Beam()] for _ in prompts]
    done: list[list[Beam]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        queued = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not queued:
            break
        outputs = llm.generate([prompts[i] + beam.token_ids for i, beam in queued], step)
        candidates: list[list[Beam]] = [[] for _ in prompts]
        for (i, beam), out in zip(queued, outputs):
            assert out.logprobs is not None
            for token, logprob in out.logprobs[0].top:
                ends = token in eos and not params.ignore_eos
                extended = Beam([*beam.token_ids, token], beam.cum_logprob + logprob, ends)
                candidates[i].append(extended)
        for i, found in enumerate(candidates):
            found.sort(key=lambda b: b.cum_logprob, reverse=True)
            live[i] = []
            for rank, beam in enumerate(found):  # transformers' rule
                if beam.finished:
                    if rank < width:  # an ending among the best `width` extensions
                        done[i].append(beam)
                elif len(live[i]) < width:
                    live[i].append(beam)
            if _settled(done[i], live[i], params):
                live[i] = []
    results = []
    for prompt, finished, unfinished in zip(prompts, done, live):
        ranked = sorted(
            finished + unfinished, key=lambda b: b.score(params.length_penalty), reverse=True
        )[:width]
        for beam in ranked:
            beam.text = llm.engine.detokenizer.decode(beam.token_ids)
        results.append(BeamSearchOutput(prompt, ranked))
    return results


def _settled(done: list[Beam], live: list[Beam], params: BeamSearchParams) -> bool:
    """``beam_width`` beams are complete and none live can beat the worst of them now (as
    transformers' ``early_stopping=True`` decides)."""
    if len(done) < params.beam_width or not live:
        return not live
    worst = sorted(b.score(params.length_penalty) for b in done)[-params.beam_width]
    return max(b.score(params.length_penalty) for b in live) <= worst
