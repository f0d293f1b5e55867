"""What the engine hands back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.sequence import SequenceMetrics


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A token's log-probability under the model, and the most likely tokens' at its position
    (``SamplingParams.logprobs`` or ``prompt_logprobs`` of them, most likely first): the
    log-softmax of the raw logits the token was decided from (for a generated token, the same
    row with or without speculation; for a prompt token, the row of the token before it)."""

    token_id: int
    logprob: float
    rank: int  # 1 + how many tokens the model found strictly more likely
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the most likely tokens


@dataclass(slots=True)
class RequestOutput:
    """A request's result so far: whole in ``LLM.generate``, a delta when streamed.

    In a streamed delta, ``token_ids`` and ``text`` hold only what is new since the previous
    delta; in a final output they hold everything generated (the prompt is never included).
    """

    request_id: int  # engine-unique id
    prompt_token_ids: list[int]  # the prompt as tokens
    token_ids: list[int] = field(default_factory=list)  # generated tokens (EOS included)
    text: str = ""  # generated text (stop strings and special tokens removed)
    finished: bool = False  # no more output will come
    finish_reason: str | None = None  # "stop" (EOS, stop token or string) or "length"
    metrics: SequenceMetrics = field(default_factory=SequenceMetrics)
    # [len(token_ids), V] float32 raw logits each generated token was decided from (the row
    # plain decoding reads, draft or not), when SamplingParams.return_logits; else None
    logits: torch.Tensor | None = None
    # one per generated token, when SamplingParams.logprobs is set; else None
    logprobs: list[TokenLogprobs] | None = None
    # one per prompt token, the first None (nothing precedes it), when
    # SamplingParams.prompt_logprobs is set; in a stream, only the first delta carries them
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # [layers + 1, positions, hidden] with SamplingParams.return_hidden_states, else None: the
    # states of every token fed, the prompt's then the output's but the last (a streamed delta:
    # those since the previous one), at index 0 the embeddings, at i the output of decoder layer
    # i - 1, at the last the final norm's output (what the logits come from)
    hidden_states: torch.Tensor | None = None
    # with SamplingParams.return_attentions, else None: per position of hidden_states' (p), each
    # layer's attention probabilities over positions 0..p, [layers, heads, p + 1] float32
    attentions: list[torch.Tensor] | None = None
    # an embedding request's pooled vector [hidden] float32, in its final output; else None
    embedding: torch.Tensor | None = None
    prompt: str | None = None  # the prompt's text where it was given as text (LLM.generate)
    # LLM.generate with SamplingParams.n > 1: completions 2..n of the prompt (this is the first)
    more_completions: list[RequestOutput] = field(default_factory=list)

    @property
    def outputs(self) -> list[RequestOutput]:
        """vLLM's shape, for code written against it: the prompt's completions, this output
        first (so ``out.outputs[0].text`` is ``out.text``), then ``more_completions``."""
        return [self, *self.more_completions]

    @property
    def cumulative_logprob(self) -> float | None:
        """The generated tokens' summed log-probability, when ``logprobs`` were asked for."""
        return None if self.logprobs is None else sum(t.logprob for t in self.logprobs)


def merge_delta(total: RequestOutput, delta: RequestOutput) -> None:
    """Add a streamed delta to the request's whole output so far (``LLM.generate``'s)."""
    total.prompt_token_ids = delta.prompt_token_ids  # the engine's: truncated, where asked
    total.token_ids += delta.token_ids
    total.text += delta.text
    if delta.logits is not None:
        parts = [delta.logits] if total.logits is None else [total.logits, delta.logits]
        total.logits = torch.cat(parts)
    if delta.hidden_states is not None:
        states = delta.hidden_states
        if total.hidden_states is not None:
            states = torch.cat([total.hidden_states, states], dim=1)
        total.hidden_states = states
    if delta.attentions is not None:
        total.attentions = [*(total.attentions or []), *delta.attentions]
    if delta.embedding is not None:
        total.embedding = delta.embedding
    if delta.logprobs is not None:
        total.logprobs = total.logprobs if total.logprobs is not None else []
        total.logprobs.extend(delta.logprobs)
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    total.finished, total.finish_reason, total.metrics = (
        delta.finished,
        delta.finish_reason,
        delta.metrics,
    )
