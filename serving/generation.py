"""One HTTP request's sequences on the engine, from admission to their last delta.

A :class:`Generation` is what both endpoints run: admit its sequences (the admission gate), add
them to the engine (through the bridge), read their deltas, and on every way out (done, client
gone, error) abort what is unfinished and give the admission room back. Streaming wraps the
deltas in server-sent events; a non-streamed request waits for all of them, unless the client
disconnects first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch
from fastapi import Request
from pydantic import BaseModel

from specdec.config import SamplingParams
from specdec.outputs import RequestOutput, TokenLogprobs
from specdec.serving.bridge import EngineDeadError, GenerationRequest
from specdec.serving.errors import APIError
from specdec.serving.metrics import SequenceTracker
from specdec.serving.responses import Usage

if TYPE_CHECKING:
    from specdec.serving.app import ServerState

T = TypeVar("T")

# Line breaks that JSON leaves unescaped but str.splitlines() splits on, as some SSE clients do.
_UNICODE_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


@dataclass(slots=True)
class Choice:
    """What one sequence of a request has produced so far."""

    text: str = ""  # generated text so far
    num_tokens: int = 0  # generated tokens so far
    finish_reason: str | None = None  # set when it finished
    logprobs: list[TokenLogprobs] | None = None  # per token, when the request asked for them
    prompt_token_ids: list[int] = field(default_factory=list)  # the prompt, as tokens
    # per prompt token (the first None), when the request asked for them (completions' echo)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: torch.Tensor | None = None  # an embedding request's vector, once finished


class Generation:
    """The sequences of one request: ``choices[i]`` belongs to ``requests[i]``."""

    def __init__(
        self,
        state: ServerState,
        requests: list[GenerationRequest],
        num_prompt_tokens: int,
        prompt_param: str,
        discard_output: bool = False,
        guide_param: str = "structured_outputs",
    ):
        """``discard_output``: show no generated token (``max_tokens`` 0 with echo: the engine
        generates one, as it must, and it is dropped). ``guide_param``: the field a guide the
        engine refuses (a pattern too large to compile) is reported under."""
        self.state = state
        self.requests = requests  # one per choice, in choice order
        self.num_prompt_tokens = num_prompt_tokens  # over distinct prompts (usage counts them once)
        self.prompt_param = prompt_param  # the field a refused prompt is reported under
        self.discard_output = discard_output
        self.guide_param = guide_param
        self.choices = [Choice() for _ in requests]
        self.arrival_time = time.perf_counter()
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._index: dict[int, int] = {}  # engine request id -> choice index
        self._trackers = [SequenceTracker(state.metrics, self.arrival_time) for _ in requests]
        self._num_unfinished = len(requests)
        self._admitted = False
        self._closed = False

    async def start(self) -> bool:
        """Admit and add the sequences; raise ``APIError`` if they are refused."""
        priority = self.requests[0].priority if self.requests else 0
        await self.state.gate.acquire(len(self.requests), priority)
        self._admitted = True
        sent = False
        try:
            await self._compile_guides()
            sent = True
            ids = await self.state.engine.add(self.requests, self._outputs)
        except ValueError as e:  # the engine's checks: the prompt, or ids of the vocabulary
            self.close()
            field = str(e).split(" ")[0]
            ids_fields = ("stop_token_ids", "logit_bias", "allowed_token_ids")
            param = field if field in ids_fields else self.prompt_param
            param = self.guide_param if field in ("regex", "grammar:") else param
            raise APIError(400, str(e), param=param) from e
        except EngineDeadError as e:
            self.close()
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from e
        except BaseException:  # cancelled: the client left; the bridge aborts what it adds
            if sent:
                self.state.metrics.finished.labels("abort").inc(len(self.requests))
            self.close()
            raise
        self._index = {request_id: i for i, request_id in enumerate(ids)}
        self.state.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        return True

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield ``(choice index, delta)`` until every sequence has finished."""
        while self._num_unfinished:
            item = await self._outputs.get()
            if isinstance(item, BaseException):
                raise APIError(503, f"Generation failed: {item}", "server_error") from item
            i = self._index[item.request_id]
            self._trackers[i].observe(item)
            if item.embedding is not None:
                self.choices[i].embedding = item.embedding
            if self.discard_output:
                logprobs: list[TokenLogprobs] | None = None if item.logprobs is None else []
                item = dataclasses.replace(
                    item, token_ids=[], text="", logprobs=logprobs, finish_reason="length"
                )
            choice = self.choices[i]
            choice.prompt_token_ids = item.prompt_token_ids
            if item.prompt_logprobs is not None:
                choice.prompt_logprobs = item.prompt_logprobs
            choice.text += item.text
            choice.num_tokens += len(item.token_ids)
            if item.logprobs is not None:
                choice.logprobs = choice.logprobs or []
                choice.logprobs.extend(item.logprobs)
            if item.finished:
                choice.finish_reason = item.finish_reason
                self._num_unfinished -= 1
            yield i, item

    async def run(self) -> bool:
        """Wait for every sequence to finish."""
        async for _ in self.deltas():
            pass
        return True

    def usage(self) -> Usage:
        completion = sum(c.num_tokens for c in self.choices)
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.num_prompt_tokens + completion,
        )

    async def _compile_guides(self) -> None:
        """Compile each distinct regex or schema on a worker thread, off the event loop and the
        engine's thread (a large schema takes a second); the engine then finds it compiled."""
        guides, seen = self.state.llm.engine.guides, set()
        for request in self.requests:
            params = request.params
            if not isinstance(params, SamplingParams):  # an embedding: nothing to compile
                continue
            key = (params.regex, str(params.json_schema), str(params.choice), params.grammar,
                   params.guide_after, params.guide_after_opening)  # fmt: skip
            compiled = any(
                p is not None for p in (params.regex, params.json_schema, params.grammar)
            )
            if (compiled or params.guide_after is not None) and key not in seen:
                seen.add(key)
                await asyncio.to_thread(guides.for_params, params)

    def close(self) -> None:
        """Abort unfinished sequences and release the admission room (safe to call again)."""
        if self._closed:
            return
        self._closed = True
        unfinished = [
            rid for rid, i in self._index.items() if self.choices[i].finish_reason is None
        ]
        self.state.engine.abort(unfinished)
        if unfinished:
            self.state.metrics.finished.labels("abort").inc(len(unfinished))
        if self._admitted:
            self.state.gate.release(len(self.requests))

    async def aclose(self) -> None:
        """``close`` as a coroutine, so that Starlette runs it on the loop, not in a thread."""
        self.close()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``, unless the client disconnects first: then cancel it and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # a no-op once it is done
    return task.result() if task in done else None


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def server_sent_events(
    generation: Generation, chunks: AsyncIterator[BaseModel]
) -> AsyncIterator[str]:
    """Frame ``chunks`` as server-sent events ending in ``[DONE]``; close the generation."""
    try:
        async for chunk in chunks:
            yield sse_event(chunk.model_dump_json())
    except APIError as e:
        yield sse_event(json.dumps(e.body()))
    finally:
        generation.close()
    yield sse_event("[DONE]")


def sse_event(data: str) -> str:
    """One server-sent event carrying ``data`` (JSON, or the final ``[DONE]``) on one line."""
    return f"data: {data.translate(_UNICODE_LINE_BREAKS)}\n\n"
