"""Embeddings: a prompt's final hidden states, pooled into one vector (vLLM's pooling API).

vLLM serves a decoder-only model as an embedding model by running each prompt through the model
and pooling the output of its final norm (the states the LM head reads): the last token's state
(``"last"``, vLLM's default for such models; under causal attention it is the only position that
has seen the whole prompt), the mean over the prompt's positions (``"mean"``), or the first
position's (``"cls"``), then, by default, scaling the vector to unit length. This module holds
that here: :class:`PoolingParams` (per request, vLLM's), :class:`Pooler` (what the engine keeps
per sequence while its prompt runs), and the outputs ``LLM.embed`` and ``/v1/embeddings`` give.

An embedding request is a prompt-only request on the ordinary engine: it is scheduled, chunked,
batched beside decodes, preempted and served from the prefix cache like any other prompt, and
the runner keeps the final states of the positions it pools (every query row of a step where a
pooling sequence runs; nothing when none does). The engine samples one greedy token after the
prompt, as it does for every prompt, and drops it. A pooler that reads more than the last
position takes nothing from the prefix cache (the cached positions would compute nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.config import SamplingParams, _check
from specdec.engine_config import POOLING_TYPES


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """How one embedding request is pooled (vLLM's ``PoolingParams``, the fields a decoder-only
    model has a use for)."""

    normalize: bool | None = None  # scale to unit L2 norm; None: yes (vLLM's embed default)
    dimensions: int | None = None  # Matryoshka truncation: refused, no model here is trained so
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: all that fit)

    def __post_init__(self) -> None:
        _check(
            self.normalize is None or isinstance(self.normalize, bool),
            f"normalize must be true, false or None, got {self.normalize!r}",
        )
        _check(
            self.dimensions is None,
            f"dimensions={self.dimensions}: this model was not trained for Matryoshka "
            "embeddings (vLLM refuses dimensions for such models too); leave it unset for the "
            "full hidden size",
        )
        k = self.truncate_prompt_tokens
        _check(
            k is None or (isinstance(k, int) and not isinstance(k, bool) and (k >= 1 or k == -1)),
            f"truncate_prompt_tokens must be a positive integer or -1, got {k!r}",
        )

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters for the request: one greedy token after the prompt (which
        the engine samples for every prompt, and which is dropped), nothing else asked for."""
        return SamplingParams(
            max_tokens=1,
            temperature=0.0,
            ignore_eos=True,
            detokenize=False,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


@dataclass(slots=True)
class Pooler:
    """What the engine keeps of one sequence's final hidden states while its prompt runs.

    ``pooled`` is the last position's state (``"last"``), position 0's (``"cls"``), or the
    float32 sum of the states so far (``"mean"``); ``num_positions`` counts the prompt positions
    taken, so that a preempted sequence, which computes its prompt again, takes each once.
    """

    pooling_type: str
    normalize: bool
    num_prompt_tokens: int
    pooled: torch.Tensor | None = None
    num_positions: int = 0

    def __post_init__(self) -> None:
        _check(
            self.pooling_type in POOLING_TYPES,
            f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}",
        )

    @property
    def reads_every_position(self) -> bool:
        """Whether positions before the last are pooled (then none may come from the cache)."""
        return self.pooling_type != "last"

    @property
    def done(self) -> bool:
        return self.num_positions >= self.num_prompt_tokens

    def take(self, states: torch.Tensor, start: int) -> None:
        """Take the final states ``[n, hidden]`` of the positions ``start .. start + n - 1``
        that a step computed (its prompt positions not taken before; output positions are
        ignored)."""
        end = min(start + states.shape[0], self.num_prompt_tokens)
        first = max(start, self.num_positions)
        if first >= end:
            return
        if self.pooling_type == "mean":
            rows = states[first - start : end - start].float().sum(dim=0)
            self.pooled = rows if self.pooled is None else self.pooled + rows
        elif self.pooling_type == "cls" and first == 0:
            self.pooled = states[0].float().clone()
        elif self.pooling_type == "last" and end == self.num_prompt_tokens:
            self.pooled = states[end - 1 - start].float().clone()
        self.num_positions = end

    def result(self) -> torch.Tensor:
        """The pooled vector ``[hidden]`` float32, once every prompt position was taken."""
        assert self.pooled is not None and self.done, "the prompt has not run yet"
        vector = self.pooled
        if self.pooling_type == "mean":
            vector = vector / self.num_prompt_tokens
        if self.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What ``LLM.embed`` gives per prompt (vLLM's shape: ``out.outputs.embedding``)."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    prompt: str | None = None  # the prompt's text, where given as text
