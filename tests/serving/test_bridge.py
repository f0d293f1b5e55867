"""The engine thread behind the event loop: deltas, refused adds, aborts, idling and shutdown."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from specdec import SamplingParams
from specdec.outputs import RequestOutput
from specdec.serving.bridge import AsyncEngine, EngineDeadError, GenerationRequest

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def run_with_engine(llm, test: Callable[[AsyncEngine], Awaitable[None]], **kwargs) -> AsyncEngine:
    """Run ``test`` on a started AsyncEngine, then shut it down and check the thread stopped."""

    async def main() -> AsyncEngine:
        engine = AsyncEngine(llm.engine, **kwargs)
        engine.start()
        try:
            await test(engine)
        finally:
            await asyncio.to_thread(engine.shutdown)
        assert not engine.is_running
        return engine

    return asyncio.run(main())


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def read_all(outputs: asyncio.Queue, num_requests: int) -> dict[int, list[RequestOutput]]:
    deltas: dict[int, list[RequestOutput]] = {}
    while sum(d[-1].finished for d in deltas.values()) < num_requests:
        delta = await outputs.get()
        deltas.setdefault(delta.request_id, []).append(delta)
    return deltas


def test_deltas_arrive_in_order_and_match_generate(make_llm):
    llm = make_llm()
    prompts = [[1, 2, 3], list(range(10, 40))]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]

    async def test(engine: AsyncEngine) -> None:
        outputs: asyncio.Queue = asyncio.Queue()
        ids = await engine.add([GenerationRequest(p, GREEDY) for p in prompts], outputs)
        deltas = await read_all(outputs, 2)
        assert [[t for d in deltas[i] for t in d.token_ids] for i in ids] == expected
        assert all(d.metrics is not deltas[ids[0]][0].metrics for d in deltas[ids[0]][1:])

    run_with_engine(llm, test)


def test_a_refused_add_raises_and_adds_nothing(make_llm):
    llm = make_llm()

    async def test(engine: AsyncEngine) -> None:
        requests = [GenerationRequest([1, 2], GREEDY), GenerationRequest([], GREEDY)]
        with pytest.raises(ValueError, match="prompt is empty"):
            await engine.add(requests, asyncio.Queue())
        await until(lambda: not llm.engine.has_unfinished())
        assert llm.engine.requests == {}

    run_with_engine(llm, test)


def test_abort_frees_the_blocks(make_llm):
    llm = make_llm(num_kv_blocks=64)
    num_blocks = llm.engine.num_blocks

    async def test(engine: AsyncEngine) -> None:
        outputs: asyncio.Queue = asyncio.Queue()
        ids = await engine.add([GenerationRequest(list(range(1, 100)), LONG)], outputs)
        await outputs.get()
        assert llm.engine.num_free_blocks < num_blocks
        engine.abort(ids)
        await until(lambda: llm.engine.num_free_blocks == num_blocks)
        assert not llm.engine.has_unfinished()

    run_with_engine(llm, test)


def test_a_caller_cancelled_while_adding_has_its_request_aborted(make_llm):
    llm = make_llm()
    added, aborted = [], []
    add_request, abort = llm.engine.add_request, llm.engine.abort

    def slow_add_request(*args):  # keeps the add's answer from arriving before the cancel
        time.sleep(0.05)
        added.append(add_request(*args))
        return added[-1]

    llm.engine.add_request = slow_add_request  # type: ignore[method-assign]
    llm.engine.abort = lambda request_id: (aborted.append(request_id), abort(request_id))  # type: ignore[method-assign]

    async def test(engine: AsyncEngine) -> None:
        request = GenerationRequest([5] * 50, LONG)
        adding = asyncio.ensure_future(engine.add([request], asyncio.Queue()))
        await asyncio.sleep(0)
        adding.cancel()
        await until(lambda: bool(added) and added[0] in aborted)
        await until(lambda: not llm.engine.has_unfinished())

    run_with_engine(llm, test)


def test_an_idle_engine_thread_waits_instead_of_spinning(make_llm):
    llm = make_llm()
    iterations: list[float] = []

    async def test(engine: AsyncEngine) -> None:
        outputs: asyncio.Queue = asyncio.Queue()
        await engine.add([GenerationRequest([1, 2, 3], GREEDY)], outputs)
        await read_all(outputs, 1)
        await asyncio.sleep(0.05)
        settled = len(iterations)
        await asyncio.sleep(0.3)
        assert len(iterations) == settled

    run_with_engine(llm, test, on_iteration=lambda engine: iterations.append(time.time()))
    assert len(iterations) >= GREEDY.max_tokens


def test_shutdown_fails_open_requests_and_refuses_new_ones(make_llm):
    llm = make_llm()
    outputs: asyncio.Queue = asyncio.Queue()

    async def test(engine: AsyncEngine) -> None:
        await engine.add([GenerationRequest([1, 2, 3], LONG)], outputs)
        await outputs.get()

    engine = run_with_engine(llm, test)

    async def after() -> None:
        while not isinstance(item := await outputs.get(), BaseException):
            pass
        assert isinstance(item, EngineDeadError)
        with pytest.raises(EngineDeadError):
            await engine.add([GenerationRequest([1], GREEDY)], asyncio.Queue())

    asyncio.run(after())
