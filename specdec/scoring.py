"""Scores of text pairs by the cosine similarity of their embeddings (vLLM's score API for an
embedding model, the "bi-encoder" case).

vLLM scores a pair ``(data_1[i], data_2[i])`` with an embedding model by embedding each text on
its own and taking the cosine of the angle between the two vectors; a single ``data_1`` is
paired with every ``data_2`` (one query against many documents), and lists of equal length are
paired position by position. ``LLM.score`` and the server's ``/score`` and ``/rerank`` routes
share the pairing and the arithmetic held here. Each distinct input is embedded once: a query
scored against ten documents runs eleven prompts, not twenty.

A decoder-only language model that was not trained for retrieval (the default model is not)
gives vectors whose cosines are a weak relevance signal; the scores are what the model's pooled
states say, no more (see :mod:`specdec.pooling` for how they are pooled).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specdec.pooling import EmbeddingRequestOutput


def score_pairs(num_1: int, num_2: int, names: tuple[str, str] = ("data_1", "data_2")) -> list[int]:
    """For each scored pair, the index of its first item: all 0 when one first item is given
    (``1 : num_2``), else ``0 .. num_2 - 1`` (``N : N``); the second items pair in order.
    A ValueError names the inputs at fault otherwise."""
    first, second = names
    if num_1 < 1 or num_2 < 1:
        empty = first if num_1 < 1 else second
        raise ValueError(f"{empty} is empty: give at least one text to score")
    if num_1 == 1:
        return [0] * num_2
    if num_1 != num_2:
        raise ValueError(
            f"{first} has {num_1} texts and {second} {num_2}: give one {first} text to score "
            f"against every {second} text, or as many as {second} to score them pair by pair"
        )
    return list(range(num_2))


def cosine_similarity(u: Sequence[float] | np.ndarray, v: Sequence[float] | np.ndarray) -> float:
    """The cosine of the angle between ``u`` and ``v``, computed in float64 (0 where either
    vector is zero)."""
    a, b = np.asarray(u, dtype=np.float64), np.asarray(v, dtype=np.float64)
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norms if norms > 0 else 0.0


def pair_scores(
    vectors_1: Sequence[Sequence[float] | np.ndarray],
    vectors_2: Sequence[Sequence[float] | np.ndarray],
    names: tuple[str, str] = ("data_1", "data_2"),
) -> list[float]:
    """The cosine similarity of each pair (see :func:`score_pairs`), in ``vectors_2``'s order."""
    firsts = score_pairs(len(vectors_1), len(vectors_2), names)
    return [cosine_similarity(vectors_1[i], v) for i, v in zip(firsts, vectors_2)]


@dataclass(slots=True)
class ScoringOutput:
    """One pair's score (vLLM's ``ScoringOutput``)."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """What ``LLM.score`` gives per pair (vLLM's shape: ``out.outputs.score``; the request id
    joins the two embedding requests' ids, and the token ids are both prompts', in order)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


def scoring_outputs(
    embedded_1: Sequence[EmbeddingRequestOutput], embedded_2: Sequence[EmbeddingRequestOutput]
) -> list[ScoringRequestOutput]:
    """``LLM.score``'s outputs from the embeddings of ``data_1`` and ``data_2``."""
    firsts = score_pairs(len(embedded_1), len(embedded_2))
    return [
        ScoringRequestOutput(
            f"{embedded_1[i].request_id}_{out.request_id}",
            embedded_1[i].prompt_token_ids + out.prompt_token_ids,
            ScoringOutput(
                cosine_similarity(embedded_1[i].outputs.embedding, out.outputs.embedding)
            ),
        )
        for i, out in zip(firsts, embedded_2)
    ]
