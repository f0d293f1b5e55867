"""A soak test for a live server: many requests, some clients hanging up, then nothing left over.

    python -m specdec.serving.soak --url http://127.0.0.1:8000 --requests 10000 --concurrency 64

It sends the load generator's mix (:mod:`specdec.serving.loadgen`: streamed and not, chat and
completions, each generating exactly its ``max_tokens``), with a share of all requests
(``--disconnect-fraction``, default one in ten) streaming and hanging up after one to three
chunks. Then it waits for the server to settle and reads ``/metrics``. The run passes when:

- no request is lost: every request that did not hang up on purpose got a complete response;
- no response is a 5xx, as the clients saw it and as the server counted it;
- nothing is left over: no sequence running or waiting, no HTTP request queued, and no KV block
  in use (blocks the prefix cache keeps for reuse are free, so they do not count).

The report adds throughput and the p50/p99 time to first token. The exit status is 1 if the run
failed, so the command can gate a release.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, replace

import click
import httpx
from prometheus_client.parser import text_string_to_metric_families

from specdec.serving.loadgen import LoadConfig, LoadReport, run_load

BUSY_GAUGES = (
    "specdec_num_requests_running",
    "specdec_num_requests_waiting",
    "specdec_num_requests_queued",
    "specdec_kv_blocks_used",
)


def scrape(url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's /metrics samples, keyed by name and labels, e.g. ``x_total{reason=abort}``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(url + "/metrics", headers=headers, timeout=30)
    response.raise_for_status()
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def server_5xx(samples: dict[str, float]) -> float:
    """5xx responses the server has counted, over every route."""
    return sum(v for k, v in samples.items() if "http_requests_total{" in k and "status=5" in k)


def wait_until_settled(url: str, api_key: str | None, timeout_s: float) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits, queues or holds a KV block (or time runs out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url, api_key)
        if not any(samples[name] for name in BUSY_GAUGES) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


@dataclass(slots=True)
class SoakReport:
    """What a soak run found."""

    num_requests: int  # requests sent
    completed: int  # complete responses
    disconnected: int  # clients that hung up on purpose
    lost: int  # requests that neither completed nor hung up on purpose
    client_5xx: int  # 5xx statuses the clients received
    server_5xx: int  # 5xx responses the server counted during the run
    aborted: int  # sequences the server aborted during the run (disconnects abort theirs)
    left_running: int  # sequences still running once settled
    left_waiting: int  # sequences still waiting in the engine once settled
    left_queued: int  # HTTP requests still waiting for admission once settled
    leaked_blocks: int  # KV blocks still in use once settled
    duration_s: float  # wall time of the load
    requests_per_s: float  # complete responses per second
    output_tokens_per_s: float  # tokens of complete responses per second
    ttft_p50_ms: float  # time to first token of streamed requests, as the clients saw it
    ttft_p99_ms: float
    errors: list[str]  # the first few failures, for the reader

    @property
    def passed(self) -> bool:
        left = self.left_running + self.left_waiting + self.left_queued + self.leaked_blocks
        return self.lost == 0 and self.client_5xx == 0 and self.server_5xx == 0 and left == 0

    def format(self) -> str:
        lines = [
            f"{self.num_requests} requests: {self.completed} complete, {self.disconnected} hung "
            f"up on purpose, {self.lost} lost",
            f"5xx: {self.client_5xx} seen by clients, {self.server_5xx} counted by the server",
            f"left over: {self.left_running} running, {self.left_waiting} waiting, "
            f"{self.left_queued} queued, {self.leaked_blocks} KV blocks in use "
            f"({self.aborted} sequences aborted)",
            f"{self.duration_s:.1f} s: {self.requests_per_s:.1f} requests/s, "
            f"{self.output_tokens_per_s:.0f} output tokens/s; time to first token "
            f"p50 {self.ttft_p50_ms:.0f} ms, p99 {self.ttft_p99_ms:.0f} ms",
            "PASS" if self.passed else "FAIL",
        ]
        return "\n".join(lines + [f"error: {e}" for e in self.errors])


def soak_config(load: LoadConfig, disconnect_share: float) -> LoadConfig:
    """``load`` with ``disconnect_share`` of all requests hanging up (only streams can)."""
    if not 0 <= disconnect_share <= load.stream_fraction:
        raise ValueError(
            f"the disconnect share ({disconnect_share}) must lie in [0, the stream fraction "
            f"({load.stream_fraction})]: only streamed requests can hang up mid-stream"
        )
    share = disconnect_share / load.stream_fraction if load.stream_fraction else 0.0
    return replace(load, disconnect_fraction=share)


async def soak(load: LoadConfig, settle_timeout_s: float = 60.0) -> SoakReport:
    """Run ``load`` against ``load.url``, let the server settle, and report."""
    before = await asyncio.to_thread(scrape, load.url, load.api_key)
    report: LoadReport = await run_load(load)
    after = await asyncio.to_thread(wait_until_settled, load.url, load.api_key, settle_timeout_s)
    summary = report.summary()
    abort_key = "specdec_request_finished_total{finish_reason=abort}"
    return SoakReport(
        num_requests=len(report.records),
        completed=int(summary["requests_ok"]),
        disconnected=int(summary["requests_disconnected"]),
        lost=len(report.errors),
        client_5xx=sum(r.status is not None and r.status >= 500 for r in report.records),
        server_5xx=int(server_5xx(after) - server_5xx(before)),
        aborted=int(after.get(abort_key, 0) - before.get(abort_key, 0)),
        left_running=int(after["specdec_num_requests_running"]),
        left_waiting=int(after["specdec_num_requests_waiting"]),
        left_queued=int(after["specdec_num_requests_queued"]),
        leaked_blocks=int(after["specdec_kv_blocks_used"]),
        duration_s=report.duration_s,
        requests_per_s=summary["requests_per_s"],
        output_tokens_per_s=summary["output_tokens_per_s"],
        ttft_p50_ms=summary["ttft_p50_ms"],
        ttft_p99_ms=summary["ttft_p99_ms"],
        errors=report.errors[:5],
    )


@click.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
@click.option("--requests", "num_requests", default=10_000, show_default=True, type=int)
@click.option("--concurrency", default=64, show_default=True, type=int)
@click.option(
    "--disconnect-fraction",
    default=0.1,
    show_default=True,
    type=float,
    help="Share of all requests that stream and hang up after 1-3 chunks.",
)
@click.option("--stream-fraction", default=0.5, show_default=True, type=float)
@click.option("--min-tokens", default=4, show_default=True, type=int)
@click.option("--max-tokens", default=32, show_default=True, type=int)
@click.option("--model", default=None, help="The `model` field; default: leave it out.")
@click.option("--api-key", envvar="SPECDEC_API_KEY", default=None)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--settle-timeout", default=60.0, show_default=True, type=float)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def main(
    url: str,
    num_requests: int,
    concurrency: int,
    disconnect_fraction: float,
    stream_fraction: float,
    min_tokens: int,
    max_tokens: int,
    model: str | None,
    api_key: str | None,
    seed: int,
    settle_timeout: float,
    as_json: bool,
) -> None:
    """Soak a running server: report lost requests, 5xx responses and leaked KV blocks."""
    load = LoadConfig(
        url,
        num_requests=num_requests,
        concurrency=concurrency,
        min_tokens=min_tokens,
        max_tokens=max_tokens,
        stream_fraction=stream_fraction,
        model=model,
        api_key=api_key,
        seed=seed,
    )
    try:
        load = soak_config(load, disconnect_fraction)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--disconnect-fraction") from e
    report = asyncio.run(soak(load, settle_timeout))
    click.echo(json.dumps(asdict(report), indent=2) if as_json else report.format())
    raise SystemExit(0 if report.passed else 1)


if __name__ == "__main__":
    main()
