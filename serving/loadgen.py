"""A load generator for an OpenAI-compatible server: concurrent requests, then latency figures.

    python -m specdec.serving.loadgen --url http://127.0.0.1:8000 --requests 500 --concurrency 64

Requests mix streamed and non-streamed, completions and chat, with prompt and output lengths drawn
at random (seeded). Each sets ``ignore_eos`` so that it generates exactly its ``max_tokens``: a
response is complete when its usage says so and it ends with a finish reason (and, streamed, with
``[DONE]``). A share of streamed clients can hang up mid-stream (``disconnect_fraction``), to
check that the server frees what they held; those count as neither complete nor failed.

Terms (measured by the client, over streamed requests only):
    TTFT: time from sending a request to its first chunk with text.
    ITL: inter-token latency, the time between successive chunks with text.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import click
import httpx

TEXT = (
    "the model reads a prompt and writes an answer one token at a time while a small draft "
    "proposes several tokens that one verification pass accepts or rejects exactly so the "
    "output never changes but the server finishes sooner under light load"
)
WORDS = TEXT.split(" ")


@dataclass(slots=True)
class LoadConfig:
    """What load to send, and where."""

    url: str  # the server's base URL, without /v1
    num_requests: int = 500  # requests in all
    concurrency: int = 64  # most requests in flight at once
    min_tokens: int = 4  # each request's max_tokens is drawn from [min_tokens, max_tokens]
    max_tokens: int = 32
    min_prompt_words: int = 4  # each prompt's length in words is drawn from this range too
    max_prompt_words: int = 64
    stream_fraction: float = 0.5  # share of requests that stream
    chat_fraction: float = 0.5  # share sent to /v1/chat/completions (the rest: /v1/completions)
    disconnect_fraction: float = 0.0  # share of streamed requests that hang up after 1-3 chunks
    model: str | None = None  # the `model` field; None: leave it out
    api_key: str | None = None  # sent as a bearer token
    seed: int = 0  # seeds the request mix and each request's sampling
    timeout_s: float = 300.0  # per request


@dataclass(slots=True)
class RequestPlan:
    """One request to send."""

    path: str  # /v1/completions or /v1/chat/completions
    body: dict  # the JSON body
    disconnect_after: int | None = None  # hang up after this many text chunks; None: read all

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request."""

    streamed: bool  # whether it streamed
    status: int | None = None  # the HTTP status; None if no response arrived
    error: str | None = None  # why it failed or is incomplete; None: complete (or disconnected)
    disconnected: bool = False  # the client hung up on purpose
    ttft_s: float | None = None  # streamed only
    itl_s: list[float] = field(default_factory=list)  # streamed only
    latency_s: float = 0.0  # from sending to the end of the response
    completion_tokens: int = 0  # as reported by usage


@dataclass(slots=True)
class LoadReport:
    """The records of a run and the figures derived from them."""

    records: list[RequestRecord]
    duration_s: float  # wall time of the whole run

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.records if r.error is not None]

    def summary(self) -> dict[str, float]:
        done = [r for r in self.records if r.error is None and not r.disconnected]
        tokens = sum(r.completion_tokens for r in done)
        ttft = [r.ttft_s for r in done if r.ttft_s is not None]
        itl = [x for r in done for x in r.itl_s]
        latency = [r.latency_s for r in done]
        figures = {
            "requests_ok": len(done),
            "requests_failed": len(self.errors),
            "requests_disconnected": sum(r.disconnected for r in self.records),
            "duration_s": self.duration_s,
            "requests_per_s": len(done) / self.duration_s,
            "output_tokens_per_s": tokens / self.duration_s,
        }
        for name, values in (("ttft", ttft), ("itl", itl), ("latency", latency)):
            for q in (50, 90, 99):
                figures[f"{name}_p{q}_ms"] = 1000 * percentile(values, q)
        return figures

    def format(self) -> str:
        s = self.summary()
        lines = [
            f"{s['requests_ok']:.0f} ok, {s['requests_failed']:.0f} failed, "
            f"{s['requests_disconnected']:.0f} disconnected in {s['duration_s']:.2f} s: "
            f"{s['requests_per_s']:.1f} requests/s, {s['output_tokens_per_s']:.0f} output tokens/s"
        ]
        for name, label in (("ttft", "TTFT"), ("itl", "inter-token"), ("latency", "latency")):
            lines.append(
                f"{label:<12} p50 {s[f'{name}_p50_ms']:8.1f} ms   p90 {s[f'{name}_p90_ms']:8.1f} ms   "
                f"p99 {s[f'{name}_p99_ms']:8.1f} ms"
            )
        lines += [f"error: {e}" for e in self.errors[:5]]
        return "\n".join(lines)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def make_plans(config: LoadConfig) -> list[RequestPlan]:
    """The requests of a run, drawn from ``config.seed``."""
    rng = random.Random(config.seed)
    plans = []
    for i in range(config.num_requests):
        words = rng.randint(config.min_prompt_words, config.max_prompt_words)
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        body: dict = {
            "max_tokens": rng.randint(config.min_tokens, config.max_tokens),
            "temperature": rng.choice([0.0, 1.0]),
            "seed": config.seed + i,
            "ignore_eos": True,
            "stream": rng.random() < config.stream_fraction,
        }
        if config.model is not None:
            body["model"] = config.model
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < config.chat_fraction:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
        else:
            path, body["prompt"] = "/v1/completions", text
        hang_up = body["stream"] and rng.random() < config.disconnect_fraction
        plans.append(RequestPlan(path, body, rng.randint(1, 3) if hang_up else None))
    return plans


async def send(
    client: httpx.AsyncClient, plan: RequestPlan, start: float | None = None
) -> RequestRecord:
    """Send one request and check that its response is complete; ``start``: the time its
    latencies count from (default: now)."""
    record = RequestRecord(streamed=plan.stream)
    start = time.perf_counter() if start is None else start
    try:
        if plan.stream:
            finish_reason = await _read_stream(client, plan, record, start)
        else:
            response = await client.post(plan.path, json=plan.body)
            record.status = response.status_code
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}: {response.text[:200]}")
            body = response.json()
            record.completion_tokens = body["usage"]["completion_tokens"]
            finish_reason = body["choices"][0]["finish_reason"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        record.error = f"{plan.path}: {type(e).__name__}: {e}"
        return record
    record.latency_s = time.perf_counter() - start
    expected = plan.body["max_tokens"]
    if not record.disconnected and (
        finish_reason != "length" or record.completion_tokens != expected
    ):
        record.error = (
            f"{plan.path}: incomplete: {record.completion_tokens} of {expected} tokens, "
            f"finish_reason={finish_reason!r}"
        )
    return record


async def _read_stream(
    client: httpx.AsyncClient, plan: RequestPlan, record: RequestRecord, start: float
) -> str | None:
    """Read a stream of server-sent events into ``record``; return the finish reason."""
    finish_reason, done, last = None, False, start
    async with client.stream("POST", plan.path, json=plan.body) as response:
        record.status = response.status_code
        if response.status_code != 200:
            raise ValueError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for data in _sse_data(response):
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ValueError(f"error event: {chunk['error']}")
            if chunk.get("usage"):
                record.completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                finish_reason = choice.get("finish_reason") or finish_reason
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    if record.ttft_s is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
            num_text_chunks = len(record.itl_s) + (record.ttft_s is not None)
            if plan.disconnect_after and num_text_chunks >= plan.disconnect_after:
                record.disconnected = True
                return None  # leaving the block closes the connection mid-stream
    if not done:
        raise ValueError("the stream ended without [DONE]")
    return finish_reason


async def _sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The data of each server-sent event (split on newlines only, unlike str.splitlines)."""
    buffer = ""
    async for text in response.aiter_text():
        *lines, buffer = (buffer + text).split("\n")
        for line in lines:
            if line.startswith("data: "):
                yield line[len("data: ") :].rstrip("\r")


async def run_arrivals(
    config: LoadConfig, plans: list[RequestPlan], arrivals: list[float]
) -> LoadReport:
    """Open loop: send ``plans[i]`` ``arrivals[i]`` seconds after the start, whether or not
    earlier requests have finished (at most ``config.concurrency`` connections); each request's
    TTFT and latency are counted from its arrival time, so waiting for a connection counts."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency)
    async with httpx.AsyncClient(
        base_url=config.url, headers=headers, timeout=config.timeout_s, limits=limits
    ) as client:
        start = time.perf_counter()

        async def one(plan: RequestPlan, at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await send(client, plan, start + at)

        records = await asyncio.gather(*(one(p, at) for p, at in zip(plans, arrivals)))
        return LoadReport(list(records), time.perf_counter() - start)


async def run_load(config: LoadConfig) -> LoadReport:
    """Send ``config.num_requests`` requests, at most ``config.concurrency`` at a time."""
    plans = make_plans(config)
    semaphore = asyncio.Semaphore(config.concurrency)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency)
    async with httpx.AsyncClient(
        base_url=config.url, headers=headers, timeout=config.timeout_s, limits=limits
    ) as client:

        async def one(plan: RequestPlan) -> RequestRecord:
            async with semaphore:
                return await send(client, plan)

        start = time.perf_counter()
        records = await asyncio.gather(*(one(plan) for plan in plans))
        return LoadReport(list(records), time.perf_counter() - start)


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
@click.option("--requests", "num_requests", default=500, show_default=True, type=int)
@click.option("--concurrency", default=64, show_default=True, type=int)
@click.option("--min-tokens", default=4, show_default=True, type=int)
@click.option("--max-tokens", default=32, show_default=True, type=int)
@click.option("--min-prompt-words", default=4, show_default=True, type=int)
@click.option("--max-prompt-words", default=64, show_default=True, type=int)
@click.option("--stream-fraction", default=0.5, show_default=True, type=float)
@click.option("--chat-fraction", default=0.5, show_default=True, type=float)
@click.option("--disconnect-fraction", default=0.0, show_default=True, type=float)
@click.option("--model", default=None)
@click.option("--api-key", envvar="SPECDEC_API_KEY", default=None)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def main(as_json: bool, **options: object) -> None:
    """Load a running server and print throughput and p50/p90/p99 TTFT and inter-token latency."""
    report = asyncio.run(run_load(LoadConfig(**options)))  # type: ignore[arg-type]
    click.echo(json.dumps(report.summary(), indent=2) if as_json else report.format())


if __name__ == "__main__":
    main()
