"""vLLM's score and rerank APIs on the served model, scored as an embedding model is: by the
cosine similarity of the two texts' embeddings (:mod:`specdec.scoring`).

- ``POST /score`` (and ``/v1/score``): pairs of texts, given as ``text_1`` and ``text_2`` or
  under vLLM's newer names (``data_1`` / ``data_2``, ``queries`` / ``documents``, ``queries`` /
  ``items``); one first text is scored against every second text, or lists of equal length
  pair by pair. ``data[i].score`` is pair ``i``'s.
- ``POST /rerank`` (and ``/v1/rerank``, Jina's path, and ``/v2/rerank``, Cohere's): a ``query``
  and ``documents`` (strings, or Cohere's ``{"text": ...}`` objects); ``results`` holds the
  documents most similar first, the ``top_n`` best (all when 0), each with its ``index`` in the
  request, its ``relevance_score`` and (unless ``return_documents`` is false) its text.

Every text runs on the engine once, as an embedding request (a query scored against ten
documents is eleven prompts), pooled by the server's ``--pooling-type``; ``usage`` counts the
tokens of the prompts that ran, each once. ``truncate_prompt_tokens`` and ``priority`` are
vLLM's, as for embeddings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, StringConstraints, field_validator

from specdec.pooling import PoolingParams
from specdec.scoring import cosine_similarity, score_pairs
from specdec.serving.adapters import adapter_of, served_name
from specdec.serving.embeddings import embed_prompts
from specdec.serving.errors import APIError
from specdec.serving.responses import Usage, new_id, now_s
from specdec.serving.routes import (
    CLIENT_CLOSED_REQUEST,
    check_model,
    check_priority_allowed,
    server_state,
    tokenize,
)
from specdec.serving.strict import StrictModel, TruncatePromptTokens

if TYPE_CHECKING:
    from specdec.serving.app import ServerState

router = APIRouter()

Text = Annotated[str, StringConstraints(min_length=1)]
# the score route's names for its two inputs, as vLLM takes them (text_1 / text_2 first)
SCORE_PAIRS = (
    ("text_1", "text_2"),
    ("data_1", "data_2"),
    ("queries", "documents"),
    ("queries", "items"),
)


class ScoringFields(StrictModel):
    """What a score and a rerank request share (vLLM's fields for an embedding model)."""

    model: str | None = None
    # keep each text's last k tokens (-1: as many as fit the context)
    truncate_prompt_tokens: TruncatePromptTokens = None
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # lower first, under priority scheduling


class ScoreRequest(ScoringFields):
    """``POST /score``: one pair of the names in :data:`SCORE_PAIRS`, each a text or a list."""

    text_1: list[Text] | None = None
    text_2: list[Text] | None = None
    data_1: list[Text] | None = None
    data_2: list[Text] | None = None
    queries: list[Text] | None = None
    documents: list[Text] | None = None
    items: list[Text] | None = None

    @field_validator(
        "text_1", "text_2", "data_1", "data_2", "queries", "documents", "items", mode="before"
    )
    @classmethod
    def _text_as_list(cls, value: Any) -> Any:  # noqa: ANN401
        return [value] if isinstance(value, str) else value

    def pair(self) -> tuple[tuple[str, str], list[str], list[str]]:
        """The names given and their texts; a 400 unless they are one of the known pairs."""
        given = {name for names in SCORE_PAIRS for name in names if getattr(self, name) is not None}
        for names in SCORE_PAIRS:
            if given == set(names):
                return names, getattr(self, names[0]), getattr(self, names[1])
        raise APIError(
            400,
            "give the texts to score as text_1 and text_2 (or data_1 and data_2, queries and "
            f"documents, queries and items); got {', '.join(sorted(given)) or 'none of them'}",
            param="text_1",
        )


class RerankDocument(BaseModel):
    text: str


class RerankRequest(ScoringFields):
    """``POST /rerank``: Jina's and Cohere's body (vLLM's route)."""

    query: Text
    documents: list[Text]  # strings, or Cohere's {"text": ...} objects (taken as their text)
    top_n: int = Field(0, ge=0)  # the best n documents; 0: all of them
    return_documents: bool = True  # Jina's and Cohere's; vLLM always returns them

    @field_validator("documents", mode="before")
    @classmethod
    def _document_texts(cls, value: Any) -> Any:  # noqa: ANN401
        if not isinstance(value, list):
            return value
        texts = [d["text"] if isinstance(d, dict) and set(d) == {"text"} else d for d in value]
        if not all(isinstance(t, str) and t for t in texts):
            raise ValueError('each document must be a non-empty string or {"text": a string}')
        return texts


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage


class RerankResult(BaseModel):
    index: int  # the document's position in the request
    document: RerankDocument | None  # left out when return_documents is false
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


async def _scores(
    request: Request,
    state: ServerState,
    body: ScoringFields,
    firsts: list[str],
    seconds: list[str],
    names: tuple[str, str],
) -> tuple[list[float], int] | None:
    """Each pair's cosine similarity and the prompt tokens that ran; None if the client left."""
    await check_model(state, body.model)
    check_priority_allowed(state, body.priority)
    try:
        pairs = score_pairs(len(firsts), len(seconds), names)
    except ValueError as e:
        raise APIError(400, str(e), param=names[0 if not firsts else 1]) from e
    truncate = body.truncate_prompt_tokens
    prompts = [await tokenize(state, t, names[0], truncate) for t in firsts]
    prompts += [await tokenize(state, t, names[1], truncate) for t in seconds]
    lora = adapter_of(state, body.model)
    vectors = await embed_prompts(
        request, state, prompts, PoolingParams(), body.priority, names[1], lora
    )
    if vectors is None:
        return None
    left, right = vectors[: len(firsts)], vectors[len(firsts) :]
    scores = [cosine_similarity(left[i].numpy(), v.numpy()) for i, v in zip(pairs, right)]
    return scores, sum(len(p) for p in prompts)


async def _score(body: ScoreRequest, request: Request) -> Response:
    state = server_state(request)
    await check_model(state, body.model)
    names, firsts, seconds = body.pair()
    result = await _scores(request, state, body, firsts, seconds, names)
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    scores, tokens = result
    response = ScoreResponse(
        id=new_id("score"),
        created=now_s(),
        model=served_name(state, body.model),
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=Usage(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens),
    )
    return Response(response.model_dump_json(), media_type="application/json")


async def _rerank(body: RerankRequest, request: Request) -> Response:
    state = server_state(request)
    texts = body.documents
    result = await _scores(request, state, body, [body.query], texts, ("query", "documents"))
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    scores, tokens = result
    order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))
    top = order[: body.top_n or len(order)]
    response = RerankResponse(
        id=new_id("rerank"),
        model=served_name(state, body.model),
        usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
        results=[
            RerankResult(
                index=i,
                document=RerankDocument(text=texts[i]) if body.return_documents else None,
                relevance_score=scores[i],
            )
            for i in top
        ],
    )
    exclude = None if body.return_documents else {"results": {"__all__": {"document"}}}
    return Response(response.model_dump_json(exclude=exclude), media_type="application/json")


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request) -> Response:
    return await _score(body, request)


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request) -> Response:
    return await _rerank(body, request)
