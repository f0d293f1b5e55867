"""Requests' ``priority`` (vLLM's extra field): refused unless the server schedules by priority;
then it orders the admission gate's line and the engine's, and changes no output."""

from __future__ import annotations

import asyncio

import pytest

from specdec import SamplingParams
from specdec.serving.limits import AdmissionGate

from .test_errors import CHAT, C, assert_error

BODY = {"prompt": "ranked", "max_tokens": 6, "ignore_eos": True, "temperature": 0}


def admission_order(gate: AdmissionGate, requests: list[tuple[int, int]]) -> list[int]:
    """Queue ``(size, priority)`` requests behind one holding the whole gate, release it, and
    return the indices in the order they were admitted (each one releasing at once)."""
    order: list[int] = []

    async def run() -> None:
        await gate.acquire(gate.max_running)

        async def wait(i: int, size: int, priority: int) -> None:
            await gate.acquire(size, priority)
            order.append(i)
            gate.release(size)

        tasks = []
        for i, (size, priority) in enumerate(requests):
            tasks.append(asyncio.create_task(wait(i, size, priority)))
            await asyncio.sleep(0)  # queued in this order
        assert gate.num_waiting == len(requests)
        gate.release(gate.max_running)
        await asyncio.gather(*tasks)

    asyncio.run(run())
    return order


@pytest.mark.parametrize(
    ("requests", "order"),
    [
        ([(1, 5), (1, 0), (1, 3)], [1, 2, 0]),
        ([(1, 0), (1, 0), (1, 0)], [0, 1, 2]),  # one priority: first come first served
        ([(1, 2), (1, -1), (1, 2), (1, -1)], [1, 3, 0, 2]),
    ],
)
def test_the_gate_admits_by_priority_then_arrival(requests, order):
    assert admission_order(AdmissionGate(2, 8), requests) == order


def test_a_waiter_that_leaves_lets_the_next_in():
    """The first in line needs more room than there is; when it gives up, the next one, which
    fits, is admitted at once (not at the next release)."""
    gate = AdmissionGate(2, 8)

    async def run() -> None:
        await gate.acquire(1)
        big = asyncio.create_task(gate.acquire(2, priority=0))
        await asyncio.sleep(0)
        small = asyncio.create_task(gate.acquire(1, priority=1))
        await asyncio.sleep(0)
        assert gate.num_waiting == 2 and not small.done()
        big.cancel()
        await asyncio.sleep(0)
        await asyncio.wait_for(small, 1)
        assert gate.num_running == 2 and gate.num_waiting == 0

    asyncio.run(run())


def test_a_priority_is_refused_without_priority_scheduling(served):
    for path, body in ((C, BODY), (CHAT, {"messages": [{"role": "user", "content": "hi"}]})):
        response = served.post(path, json={**body, "priority": 3})
        assert_error(response, 400, "--scheduling-policy priority", "priority")
        assert served.post(path, json={**body, "priority": 0}).status_code == 200


def test_priorities_change_no_output(make_server, offline):
    served = make_server(scheduling_policy="priority")
    engine, seen = served.llm.engine, []
    add = engine.add_request
    engine.add_request = lambda ids, params, priority=0, lora=None: (  # type: ignore[method-assign]
        seen.append(priority) or add(ids, params, priority, lora)
    )
    texts = []
    for priority in (-7, 0, 12):
        response = served.post(C, json={**BODY, "priority": priority})
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    beams = served.post(C, json={**BODY, "priority": 4, "use_beam_search": True, "n": 2})
    assert beams.status_code == 200, beams.text
    assert texts == [texts[0]] * 3
    assert seen[:3] == [-7, 0, 12] and set(seen[3:]) == {4}  # the beams' steps too
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    expected = offline.generate("ranked", params)[0].text
    assert texts[0] == expected
    bad = served.post(C, json={**BODY, "priority": 2.5})
    assert bad.status_code == 400 and "priority" in bad.text
