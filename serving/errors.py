"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every error the server sends has this body, whatever raised it: a handler (:class:`APIError`),
FastAPI's request validation (400 naming the offending field), a body that is not JSON (400
saying why: invalid UTF-8, nesting too deep, a number too long), Starlette's routing (404, 405)
or an unexpected exception (500, logged with its traceback; the body never carries the
exception's text). Bodies are rendered as ASCII JSON, so an echoed value that is not valid
Unicode cannot break the response.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error to send to the client as an OpenAI error body with this HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code  # HTTP status
        self.message = message  # what went wrong and how to fix it
        self.type = type  # OpenAI's error class, e.g. "invalid_request_error"
        self.param = param  # the request field at fault, if one is
        self.code = code  # a machine-readable reason, e.g. "model_not_found"
        self.headers = dict(headers or {})  # extra response headers, e.g. Retry-After

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return AsciiJSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: renders any string, lone surrogates too."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def field_path(loc: Sequence[str | int]) -> str:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def validation_error(errors: Sequence[Any]) -> APIError:
    """One 400 for FastAPI's validation errors, naming each field at fault and what it got."""
    first = errors[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "invalid JSON")
        return APIError(400, f"Malformed JSON body: {reason} (at character {first['loc'][-1]})")
    if first["loc"] == ("body",):
        if first["type"] == "missing":
            return APIError(400, "The request body is empty: send a JSON object")
        return APIError(
            400,
            "The request body must be a JSON object, sent with Content-Type: application/json",
        )
    messages = []
    for error in errors:
        text = str(error["msg"]).removeprefix("Value error, ")
        got = "" if error["type"] == "missing" else f" (got {_short(error.get('input'))})"
        messages.append(f"{field_path(error['loc'])}: {text}{got}")
    return APIError(400, "; ".join(messages), param=field_path(first["loc"]) or None)


def body_parse_error(cause: BaseException | None) -> APIError:
    """A 400 saying why a body that looked like JSON could not be parsed (FastAPI chains the
    parser's exception to its generic "There was an error parsing the body")."""
    if isinstance(cause, UnicodeDecodeError):
        message = (
            f"The request body is not valid UTF-8: {cause.reason} at byte {cause.start} "
            f"({cause.object[cause.start : cause.start + 1]!r})"
        )
    elif isinstance(cause, RecursionError):
        message = "The JSON body is nested too deeply: keep arrays and objects a few levels deep"
    elif isinstance(cause, ValueError) and "digits" in str(cause):
        limit = sys.get_int_max_str_digits()
        message = f"A number in the JSON body is too long: integers may have at most {limit} digits"
    else:
        name = type(cause).__name__ if cause is not None else "unknown error"
        message = f"The request body could not be read as JSON ({name})"
    return APIError(400, message)


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Make every error response of ``app`` an OpenAI error body."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc.errors()).response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 400 and exc.__cause__ is not None:
            return body_parse_error(exc.__cause__).response()
        if exc.status_code == 404:
            message = f"Unknown route: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, message, kind, headers=exc.headers).response()

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return internal_error().response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)  # a last resort: see UnexpectedErrors


def internal_error() -> APIError:
    return APIError(500, "Internal server error: the server logged the details", "server_error")


class UnexpectedErrors:
    """Answer an unexpected exception with a 500 in OpenAI's shape, and keep the connection.

    Starlette's own handler for ``Exception`` runs outside every middleware and re-raises after
    it has answered, so the request counter never saw the 500 and uvicorn closed the connection:
    a client reusing it lost its next request. An exception after the response has started
    cannot be answered any more; it is raised, and the server ends the connection.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            if started:
                raise
            logger.exception("unexpected error on %s %s", scope["method"], scope["path"])
            await internal_error().response()(scope, receive, send)
