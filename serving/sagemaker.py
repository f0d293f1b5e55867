"""The two routes Amazon SageMaker's model containers call, as vLLM serves them: ``/ping`` (the
health check, ``GET`` or ``POST``) and ``POST /invocations``, which takes a chat completions
body (one with ``messages``) or a completions body (one with ``prompt``) and answers as that
route does, stream included. ``/invocations`` needs the API key when the server has one.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from specdec.serving.errors import APIError
from specdec.serving.protocol import ChatCompletionRequest, CompletionRequest
from specdec.serving.routes import chat_completions, completions, health

router = APIRouter()


@router.get("/ping")
async def ping(request: Request) -> Response:
    return await health(request)


@router.post("/ping")
async def ping_post(request: Request) -> Response:  # SageMaker may use either method
    return await health(request)


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    """A chat completion for a body with ``messages``, a completion for one with ``prompt``."""
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"The body is not valid JSON: {e}") from e
    if not isinstance(body, dict) or ("messages" in body) == ("prompt" in body):
        raise APIError(
            400,
            "an /invocations body holds either messages (a chat completion) or prompt (a "
            "completion)",
        )
    try:
        if "messages" in body:
            return await chat_completions(ChatCompletionRequest.model_validate(body), request)
        return await completions(CompletionRequest.model_validate(body), request)
    except ValidationError as e:  # as the routes' own bodies are refused
        raise RequestValidationError(e.errors()) from e
