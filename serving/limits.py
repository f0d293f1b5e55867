"""What the server lets in: the API key, the body size, and how many requests run or wait.

Terms:
    longest token: the most characters one token of the vocabulary stands for. A text of ``c``
        characters is at least ``c / longest`` tokens, so a prompt longer than
        :func:`max_prompt_chars` cannot fit the context and is refused before it is tokenized.
    running sequences: sequences admitted to the engine and not yet finished or aborted (a request
        with ``n`` choices over ``p`` prompts holds ``n * p``).
    waiting requests: HTTP requests that wait for room to run, in order of priority (lower
        first; all 0 unless the server schedules by priority), then of arrival. Beyond
        ``max_waiting`` of them a request is refused at once with 503 and ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import secrets
from collections import deque
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.serving.errors import APIError

# Headroom for tokenizers whose normalizer shortens text (accent stripping, say) before it is split.
_NORMALIZER_HEADROOM = 2


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:  # noqa: ANN401 - transformers
    """Characters beyond which a prompt's text cannot fit ``max_model_len`` tokens."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_model_len * max(longest, 1) * _NORMALIZER_HEADROOM


class AdmissionGate:
    """At most ``max_running`` sequences on the engine; at most ``max_waiting`` requests queued."""

    def __init__(self, max_running: int, max_waiting: int, retry_after_s: int = 1):
        self.max_running = max_running  # most running sequences
        self.max_waiting = max_waiting  # most requests waiting for room
        self.retry_after_s = retry_after_s  # the Retry-After sent with a refusal
        self.num_running = 0  # sequences admitted and not yet released
        # (priority, arrival, size, wake-up), in that order: the first is admitted first
        self._waiters: list[tuple[int, int, int, asyncio.Future]] = []
        self._arrivals = itertools.count()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, num_seqs: int, priority: int = 0) -> None:
        """Wait for room for ``num_seqs`` sequences, behind waiters of lower or equal
        ``priority``; raise a 400 or 503 ``APIError`` if none."""
        if num_seqs > self.max_running:
            raise APIError(
                400,
                f"this request has {num_seqs} sequences (prompts x n), but the server runs at "
                f"most {self.max_running} at once: send fewer prompts or a smaller n",
                param="n",
            )
        if not self._waiters and self.num_running + num_seqs <= self.max_running:
            self.num_running += num_seqs
            return
        if self.num_waiting >= self.max_waiting:
            raise APIError(
                503,
                f"The server is overloaded ({self.num_running} sequences running, "
                f"{self.num_waiting} requests waiting): retry later",
                type="server_overloaded",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        admitted = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._arrivals), num_seqs, admitted)
        bisect.insort(self._waiters, entry, key=lambda e: e[:2])
        self._admit_waiters()  # a more urgent request may fit where the first in line did not
        try:
            await admitted
        except asyncio.CancelledError:
            if admitted.done() and not admitted.cancelled():
                self.release(num_seqs)  # admitted just as the caller gave up
            elif entry in self._waiters:
                self._waiters.remove(entry)
                self._admit_waiters()  # those behind it may fit where it did not
            raise

    def release(self, num_seqs: int) -> None:
        """Give back the room of ``num_seqs`` sequences and admit waiters, in order."""
        self.num_running -= num_seqs
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        """Admit waiters from the first while each fits."""
        while self._waiters and self.num_running + self._waiters[0][2] <= self.max_running:
            _, _, num, admitted = self._waiters.pop(0)
            if not admitted.cancelled():
                self.num_running += num
                admitted.set_result(None)


class BodyLimitMiddleware:
    """Refuse request bodies larger than ``max_bytes`` with 413 before anything parses them."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        body, messages = 0, []  # a chunked body is read here, then replayed to the app
        while True:
            message = await receive()
            messages.append(message)
            body += len(message.get("body", b""))
            if body > self.max_bytes:
                return await self._refuse(scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        await self.app(scope, _replay(messages, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413,
            f"The request body is larger than {self.max_bytes} bytes",
            code="request_too_large",
        )
        await error.response()(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that first returns ``messages``, then whatever ``receive`` returns."""
    pending = deque(messages)

    async def replayed() -> Message:
        return pending.popleft() if pending else await receive()

    return replayed


class ApiKeyMiddleware:
    """Refuse protected paths without ``Authorization: Bearer <api_key>`` with 401.

    The scheme name is case-insensitive (RFC 7235: ``bearer`` and ``BEARER`` work too); the key
    is compared in constant time.
    """

    def __init__(self, app: ASGIApp, api_key: str, is_protected: Callable[[str], bool]):
        self.app = app
        self.expected = api_key.encode()
        self.is_protected = is_protected  # which paths need the key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.is_protected(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, key = given.strip().partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(
                key.strip(), self.expected
            ):
                error = APIError(
                    401,
                    "Missing or incorrect API key: send the header `Authorization: Bearer <key>`",
                    type="authentication_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)
