"""The server's Prometheus metrics, served at ``GET /metrics``.

Each server has a registry of its own, so that several servers in one process do not clash.
Latencies are measured on the event loop, as a client would see them, from the moment the HTTP
handler received the request (time spent waiting for admission included).

Terms:
    time to first token (TTFT): from receiving the request to the first generated token of a
        sequence reaching the HTTP handler.
    inter-token latency (ITL): time per generated token after the first one. A delta of ``k``
        tokens arriving ``dt`` after the previous one counts ``k`` observations of ``dt / k``,
        so that a step that accepts several draft tokens shows as lower latency per token.
    draft: the tokens a drafter proposes for one sequence in one step; ``position`` ``j`` of a
        draft is accepted when the first ``j + 1`` draft tokens all are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdec.engine import Engine
from specdec.outputs import RequestOutput
from specdec.verifier import SpecStats

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)
E2E_BUCKETS = (0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    """Counters, gauges and histograms of one server, in their own ``CollectorRegistry``."""

    def __init__(self, spec_stats: Callable[[], SpecStats | None] = lambda: None) -> None:
        """``spec_stats`` gives the engine's speculation counters (drafts verified and accepted),
        read at each scrape: acceptance is counted once, by the verifier, not again here."""
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "specdec_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.finished = Counter(
            "specdec_request_finished", "Sequences ended, by reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(
            "specdec_generation_tokens", "Tokens generated", registry=r
        )
        self.ttft = Histogram(
            "specdec_time_to_first_token_seconds",
            "Time to first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "specdec_inter_token_latency_seconds",
            "Time per token after the first",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "specdec_e2e_request_latency_seconds",
            "Time to the last token",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            "specdec_num_requests_running", "Sequences in the engine's running batch", registry=r
        )
        self.waiting = Gauge(
            "specdec_num_requests_waiting", "Sequences queued in the engine", registry=r
        )
        self.queued = Gauge(
            "specdec_num_requests_queued",
            "HTTP requests waiting for admission (--max-concurrent)",
            registry=r,
        )
        self.kv_blocks_used = Gauge("specdec_kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_blocks_total = Gauge("specdec_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.lora_info = Gauge(  # vLLM's lora_requests_info: one series, its labels the news
            "specdec_lora_requests_info",
            "LoRA adapters of the running and waiting sequences (value: when observed)",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )
        r.register(SpeculationCollector(spec_stats))

    def observe_engine(self, engine: Engine) -> None:
        """Record the engine's queue lengths and KV use (called by the engine thread)."""
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        self.kv_blocks_used.set(engine.num_blocks - engine.num_free_blocks)
        self.kv_blocks_total.set(engine.num_blocks)
        if engine.loras is not None:
            names = {a.key: a.request.name for a in engine.loras.loaded.values()}
            running, waiting = (
                ",".join(sorted({names.get(s.lora_key, "") for s in seqs if s.lora_key}))
                for seqs in (engine.scheduler.running, engine.scheduler.waiting)
            )
            self.lora_info.clear()
            self.lora_info.labels(str(engine.config.max_loras), running, waiting).set(time.time())

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SpeculationCollector(Collector):
    """The verifier's counters as Prometheus counters, read when ``/metrics`` is scraped."""

    def __init__(self, spec_stats: Callable[[], SpecStats | None]):
        self.spec_stats = spec_stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.spec_stats() or SpecStats()
        yield CounterMetricFamily(
            "specdec_spec_decode_num_drafts", "Drafts verified", value=stats.num_verify_steps
        )
        yield CounterMetricFamily(
            "specdec_spec_decode_num_draft_tokens",
            "Draft tokens verified",
            value=stats.num_draft_tokens,
        )
        yield CounterMetricFamily(
            "specdec_spec_decode_num_accepted_tokens",
            "Draft tokens accepted",
            value=stats.num_accepted_tokens,
        )
        per_position = CounterMetricFamily(
            "specdec_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in their draft",
            labels=["position"],
        )
        for position, accepted in enumerate(list(stats.accepted_per_position)):
            per_position.add_metric([str(position)], accepted)
        yield per_position


class SequenceTracker:
    """Turns the deltas of one sequence into latency and token metrics."""

    __slots__ = ("metrics", "arrival_time", "last_time")

    def __init__(self, metrics: ServerMetrics, arrival_time: float):
        self.metrics = metrics
        self.arrival_time = arrival_time  # time.perf_counter() when the HTTP request arrived
        self.last_time: float | None = None  # when the previous tokens arrived

    def observe(self, delta: RequestOutput) -> None:
        m, now, num_tokens = self.metrics, time.perf_counter(), len(delta.token_ids)
        if num_tokens:
            m.generation_tokens.inc(num_tokens)
            if self.last_time is None:
                m.ttft.observe(now - self.arrival_time)
            else:
                for _ in range(num_tokens):
                    m.itl.observe((now - self.last_time) / num_tokens)
            self.last_time = now
        if delta.finished:
            m.e2e.observe(now - self.arrival_time)
            m.finished.labels(delta.finish_reason or "unknown").inc()


class RequestCountMiddleware:
    """Count every HTTP response by route (``other`` for unknown paths) and status code."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: frozenset[str]):
        self.app = app
        self.metrics = metrics
        self.routes = routes  # the paths counted under their own name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
