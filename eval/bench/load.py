"""Load mode: open-loop Poisson arrivals at several request rates, with and without a drafter.

Requests arrive at exponentially spaced times (a Poisson process of rate ``r`` requests/s, seeded)
whether or not earlier ones have finished, as traffic does, so queueing shows in the latency.
In process, one loop adds each request at its arrival time and steps the engine; against a
running ``specdec serve`` (``url``), :func:`specdec.serving.loadgen.run_arrivals` sends streamed
chat requests at those times. Both give a :class:`~specdec.serving.loadgen.LoadReport`:
throughput, and time to first token, inter-token latency (the gap between streamed chunks, as
vLLM's benchmark counts it: a chunk of several accepted tokens is one gap) and end-to-end latency
at p50, p90 and p99, each measured from the request's arrival.

Speculation *pays* at a rate when its median end-to-end latency is below plain decoding's at
that rate; :func:`break_even` finds the rate from which on it stops paying.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from specdec.eval.bench.systems import Sampling
from specdec.serving.loadgen import LoadConfig, LoadReport, RequestPlan, RequestRecord, run_arrivals


def arrival_times(rate: float, num_requests: int, seed: int = 0) -> list[float]:
    """Seconds from the start at which each request arrives: a Poisson process of ``rate``."""
    if rate <= 0:
        raise ValueError(f"a request rate must be positive, got {rate}")
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def run_in_process(
    llm: Any,
    requests: list[tuple[list[int], int]],
    arrivals: list[float],
    sampling: Sampling | None = None,
) -> LoadReport:
    """Feed ``requests`` (prompt ids, new tokens) to ``llm``'s engine at ``arrivals``; every
    request generates exactly its tokens (EOS ignored), greedily unless ``sampling`` says."""
    sampling = sampling or Sampling()
    engine = llm.engine
    records: dict[int, RequestRecord] = {}
    arrived: dict[int, float] = {}
    last: dict[int, float] = {}
    start = time.perf_counter()
    i = 0
    while i < len(requests) or engine.has_unfinished():
        now = time.perf_counter()
        while i < len(requests) and start + arrivals[i] <= now:
            prompt, max_tokens = requests[i]
            params = sampling.params(prompt, max_tokens, ignore_eos=True)
            rid = engine.add_request(prompt, params)
            records[rid] = RequestRecord(streamed=True, status=200)
            arrived[rid] = last[rid] = start + arrivals[i]
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            continue
        for delta in engine.step():
            t = time.perf_counter()
            record = records[delta.request_id]
            if delta.token_ids:
                if record.ttft_s is None:
                    record.ttft_s = t - arrived[delta.request_id]
                else:
                    record.itl_s.append(t - last[delta.request_id])
                last[delta.request_id] = t
                record.completion_tokens += len(delta.token_ids)
            if delta.finished:
                record.latency_s = t - arrived[delta.request_id]
    return LoadReport(list(records.values()), time.perf_counter() - start)


def run_over_http(
    url: str,
    requests: list[tuple[list[dict[str, str]], int]],
    arrivals: list[float],
    api_key: str | None = None,
) -> LoadReport:
    """Send ``requests`` (a conversation, new tokens) to a running server at ``arrivals``."""
    plans = []
    for messages, max_tokens in requests:
        body = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        plans.append(RequestPlan("/v1/chat/completions", body))
    config = LoadConfig(
        url=url, num_requests=len(plans), concurrency=max(1, len(plans)), api_key=api_key
    )
    return asyncio.run(run_arrivals(config, plans, arrivals))


def break_even(
    curve: dict[str, list[dict[str, float]]], drafter: str, baseline: str
) -> float | None:
    """The lowest measured rate from which on ``drafter``'s median latency is no better than
    ``baseline``'s at every higher rate too (None: it still pays at the highest rate measured).
    ``curve``: per system, one summary per rate (``rate``, ``latency_p50_ms``), in rate order."""
    stop = None
    for mine, theirs in zip(curve[drafter], curve[baseline]):
        if mine["latency_p50_ms"] < theirs["latency_p50_ms"]:
            stop = None
        elif stop is None:
            stop = mine["rate"]
    return stop


def paying_summary(curve: dict[str, list[dict[str, float]]], drafter: str, baseline: str) -> str:
    """Where ``drafter`` pays under load, in words: at every rate, at none, below the rate from
    which on it stops paying, or at which rates it does and does not (a quick run's few requests
    can give a drafter a slow point at a low rate and a fast one above it)."""
    rates = [point["rate"] for point in curve[drafter]]
    pays = [
        mine["rate"]
        for mine, theirs in zip(curve[drafter], curve[baseline])
        if mine["latency_p50_ms"] < theirs["latency_p50_ms"]
    ]
    if len(pays) == len(rates):
        return "pays at every rate measured"
    if not pays:
        return "pays at no rate measured"
    stop = break_even(curve, drafter, baseline)
    if stop is not None and pays == [r for r in rates if r < stop]:
        return f"stops paying at {stop:.2f} req/s"
    others = [r for r in rates if r not in pays]
    return f"pays at {_listed(pays)} req/s, not at {_listed(others)}"


def _listed(rates: list[float]) -> str:
    return ", ".join(f"{r:.2f}" for r in rates)
