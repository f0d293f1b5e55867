"""The bridge between the HTTP event loop and the engine, which is single-threaded.

Terms:
    engine thread: the one thread that owns the :class:`~specdec.engine.Engine`; nothing else
        touches it. It runs steps while requests are unfinished and, when idle, blocks on the
        command queue instead of spinning.
    command: an add, an abort or a stop, sent by the event loop through a thread-safe queue and
        carried out by the engine thread between two steps.
    output queue: an ``asyncio.Queue`` per HTTP request. After each step the engine thread hands
        every new delta (:class:`~specdec.outputs.RequestOutput`) to the event loop with one
        ``loop.call_soon_threadsafe``, which puts it on its request's queue. Callbacks run in
        order, so a request learns its ids before any of its deltas arrive.

The event loop never waits on the engine: ``add`` awaits a future that the engine thread resolves
after ``Engine.add_request`` (its ``ValueError`` is raised in the HTTP handler), and ``abort`` is a
put on the command queue. If a step raises, the engine thread fails every open request with
:class:`EngineDeadError` and exits; the server then reports itself unhealthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.lora import LoRARequest
from specdec.outputs import RequestOutput
from specdec.pooling import PoolingParams

logger = logging.getLogger(__name__)

OutputQueue = asyncio.Queue  # of RequestOutput, or an exception that ends the request


class EngineDeadError(RuntimeError):
    """The engine thread is not running (it failed, or the server is shutting down)."""


@dataclass(slots=True)
class GenerationRequest:
    """One sequence to generate: the prompt, how to sample it, and per-request engine options."""

    prompt_token_ids: list[int]  # the prompt, tokenized
    params: SamplingParams | PoolingParams  # how to sample the continuation, or to pool
    num_speculative_tokens: int | None = None  # drafts per step (0: off); None: the engine's own
    priority: int = 0  # under the priority scheduling policy, lower first
    lora: LoRARequest | None = None  # the LoRA adapter it runs through (specdec.lora)


@dataclass(slots=True)
class _Add:
    requests: list[GenerationRequest]  # added together: all or none
    outputs: OutputQueue  # where their deltas go
    accepted: asyncio.Future  # resolved with the engine request ids, or the add's ValueError


@dataclass(slots=True)
class _Call:
    function: Callable[[Engine], Any]  # run on the engine thread, between steps
    result: asyncio.Future  # resolved with what it returns, or what it raises


@dataclass(slots=True)
class _Abort:
    request_ids: list[int]  # engine request ids; finished or unknown ones are ignored


_STOP = object()  # the command that ends the engine thread


class AsyncEngine:
    """Runs ``engine`` in its own thread and serves it to coroutines on one event loop."""

    def __init__(self, engine: Engine, on_iteration: Callable[[Engine], None] | None = None):
        self.engine = engine  # owned by the engine thread once started
        self.on_iteration = on_iteration  # called by the engine thread after each step or batch
        self.error: BaseException | None = None  # why the engine thread died, if it did
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs: dict[int, OutputQueue] = {}  # engine request id -> its output queue
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False  # whether new adds may be queued (guarded by _lock)
        self._lock = threading.Lock()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the engine thread; call from a coroutine on the loop that will use this engine."""
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request and stop the engine thread (blocks until it has stopped)."""
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the engine thread did not stop within {timeout} s")

    async def add(self, requests: list[GenerationRequest], outputs: OutputQueue) -> list[int]:
        """Queue ``requests`` on the engine; their deltas will arrive on ``outputs``.

        Returns their engine request ids. Raises the engine's ``ValueError`` (nothing is added
        then) or :class:`EngineDeadError`. If the caller is cancelled while waiting, the requests
        are aborted as soon as they are added.
        """
        with self._lock:
            if not self._accepting or self._loop is None:
                raise EngineDeadError("the engine is not running")
            accepted = self._loop.create_future()
            self._commands.put(_Add(requests, outputs, accepted))
        return await accepted

    async def call(self, function: Callable[[Engine], Any]) -> Any:  # noqa: ANN401
        """``function(engine)`` run on the engine thread between steps (loading a LoRA adapter);
        what it returns, or raises. Raises :class:`EngineDeadError` if the engine is stopped."""
        with self._lock:
            if not self._accepting or self._loop is None:
                raise EngineDeadError("the engine is not running")
            result = self._loop.create_future()
            self._commands.put(_Call(function, result))
        return await result

    def abort(self, request_ids: list[int]) -> None:
        """Abort requests and free their KV blocks, soon (thread-safe, never blocks)."""
        if request_ids:
            self._commands.put(_Abort(list(request_ids)))

    def _run(self) -> None:
        try:
            while self._handle_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
                if self.on_iteration is not None:
                    self.on_iteration(self.engine)
            self.error = EngineDeadError("the server is shutting down")
        except BaseException:  # noqa: BLE001 - every request must learn that it failed
            logger.exception("the engine thread failed; open requests are failed")
            self.error = EngineDeadError("the engine failed (the server logged why)")
        finally:
            with self._lock:
                self._accepting = False
            self._post(_fail_all, set(self._outputs.values()), self.error)
            self._fail_pending_adds()
            for request_id in self._outputs:  # best effort: a failed engine may fail again
                with contextlib.suppress(Exception):
                    self.engine.abort(request_id)
            self._outputs.clear()

    def _handle_commands(self, block: bool) -> bool:
        """Carry out queued commands (waiting for one if ``block``); False once told to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
            while True:
                if command is _STOP:
                    return False
                if isinstance(command, _Add):
                    self._add(command)
                elif isinstance(command, _Call):
                    self._call(command)
                else:
                    for request_id in command.request_ids:
                        self._outputs.pop(request_id, None)
                        self.engine.abort(request_id)
                command = self._commands.get_nowait()
        except queue.Empty:
            return True

    def _add(self, command: _Add) -> None:
        ids: list[int] = []
        try:
            for request in command.requests:
                params = request.params
                if request.num_speculative_tokens is not None and isinstance(
                    params, SamplingParams
                ):  # this request's own cap
                    params = replace(params, num_speculative_tokens=request.num_speculative_tokens)
                ids.append(
                    self.engine.add_request(
                        request.prompt_token_ids, params, request.priority, request.lora
                    )
                )
        except Exception as e:  # noqa: BLE001 - a refused request must not stop the engine
            for request_id in ids:
                self.engine.abort(request_id)
            self._post(self._resolve, command, e)
            return
        for request_id in ids:
            self._outputs[request_id] = command.outputs
        self._post(self._resolve, command, ids)

    def _call(self, command: _Call) -> None:
        try:
            result = command.function(self.engine)
        except Exception as e:  # noqa: BLE001 - the caller gets it; the engine goes on
            self._post(_settle, command.result, e)
        else:
            self._post(_settle, command.result, result)

    def _resolve(self, command: _Add, result: list[int] | Exception) -> None:
        """On the loop: answer an add, or abort its requests if nobody waits any more."""
        if command.accepted.cancelled():
            self.abort(result if isinstance(result, list) else [])
        elif isinstance(result, Exception):
            command.accepted.set_exception(result)
        else:
            command.accepted.set_result(result)

    def _step(self) -> None:
        deliveries = []
        for delta in self.engine.step():
            outputs = self._outputs.get(delta.request_id)
            if outputs is None:
                continue
            if delta.finished:
                del self._outputs[delta.request_id]
            delta.metrics = copy.copy(delta.metrics)  # a snapshot: the engine keeps mutating it
            deliveries.append((outputs, delta))
        if deliveries:
            self._post(_deliver, deliveries)

    def _fail_pending_adds(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            dead = EngineDeadError("the engine is not running")
            if isinstance(command, _Add):
                self._post(self._resolve, command, dead)
            elif isinstance(command, _Call):
                self._post(_settle, command.result, dead)

    def _post(self, callback: Callable, *args: object) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
            self._loop.call_soon_threadsafe(callback, *args)


def _deliver(deliveries: list[tuple[OutputQueue, RequestOutput]]) -> None:
    for outputs, delta in deliveries:
        outputs.put_nowait(delta)


def _fail_all(queues: set[OutputQueue], error: BaseException | None) -> None:
    for outputs in queues:
        outputs.put_nowait(error or EngineDeadError("the engine stopped"))


def _settle(future: asyncio.Future, result: object) -> None:
    """On the loop: answer a call (an exception is raised to the caller), unless nobody waits."""
    if future.cancelled():
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
