"""Bounded load on loopback: every response complete, and afterwards every KV block free."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from click.testing import CliRunner

from specdec.serving import soak
from specdec.serving.loadgen import LoadConfig, run_load
from specdec.serving.soak import scrape

from .conftest import MODEL

ABORTED = "specdec_request_finished_total{finish_reason=abort}"


def wait_until_metrics_idle(
    url: str, timeout_s: float = 10.0, aborted: float | None = None
) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds a KV block (and, where ``aborted`` is
    given, until that many requests have been aborted: a handler may start after its client
    has left, so the engine can be idle before it has seen the request)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(url)
        busy = ("specdec_num_requests_running", "specdec_num_requests_waiting")
        idle = m["specdec_kv_blocks_used"] == 0 and not any(m[name] for name in busy)
        if idle and (aborted is None or m.get(ABORTED, 0) >= aborted):
            return m
        assert time.monotonic() < deadline, {
            k: v for k, v in m.items() if "kv" in k or "abort" in k
        }
        time.sleep(0.02)


def test_500_mixed_requests_at_64_concurrency_all_complete(make_server):
    served = make_server(num_kv_blocks=512)
    config = LoadConfig(
        served.url, num_requests=500, concurrency=64, min_tokens=1, max_tokens=16, model=MODEL
    )
    report = asyncio.run(run_load(config))
    assert report.errors == []
    summary = report.summary()
    assert summary["requests_ok"] == 500 and summary["requests_disconnected"] == 0
    streamed = [r for r in report.records if r.streamed]
    assert 150 < len(streamed) < 350  # the mix has both kinds
    # Random bytes from a tiny model may decode to no text at all; most do not.
    assert sum(r.ttft_s is not None for r in streamed) > 0.8 * len(streamed)
    m = wait_until_metrics_idle(served.url)
    assert m["specdec_generation_tokens_total"] == sum(r.completion_tokens for r in report.records)
    served.wait_until_idle()


def test_clients_that_hang_up_mid_stream_have_their_requests_aborted(make_server):
    served = make_server(num_kv_blocks=512)
    config = LoadConfig(
        served.url,
        num_requests=120,
        concurrency=64,
        min_tokens=150,
        max_tokens=300,
        max_prompt_words=16,
        stream_fraction=0.8,
        disconnect_fraction=0.6,
        model=MODEL,
        seed=1,
    )
    report = asyncio.run(run_load(config))
    assert report.errors == []
    disconnected = report.summary()["requests_disconnected"]
    assert disconnected > 30
    m = wait_until_metrics_idle(served.url)
    assert m[ABORTED] >= disconnected * 0.9
    served.wait_until_idle()


def test_clients_that_time_out_on_a_full_response_have_their_requests_aborted(served):
    body = {"model": MODEL, "prompt": "slow", "max_tokens": 500, "ignore_eos": True}

    async def impatient() -> None:
        timeout = httpx.Timeout(10.0, read=0.05)  # only the wait for the response runs out
        async with httpx.AsyncClient(base_url=served.url, timeout=timeout) as client:
            for result in await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(4)),
                return_exceptions=True,
            ):
                assert isinstance(result, httpx.ReadTimeout)

    before = scrape(served.url).get(ABORTED, 0)
    asyncio.run(impatient())
    m = wait_until_metrics_idle(served.url, aborted=before + 4)
    assert m[ABORTED] - before == 4
    served.wait_until_idle()


def test_a_client_that_leaves_while_its_request_is_added_has_it_counted_as_aborted(make_server):
    """The engine thread answers the add late, so the client is gone before the request is on
    the engine: the bridge aborts it once added, and the counter must see that abort too."""
    served = make_server()
    engine, added = served.llm.engine, []
    add_request = engine.add_request

    def slow_add_request(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(0.3)
        added.append(add_request(*args, **kwargs))
        return added[-1]

    engine.add_request = slow_add_request  # type: ignore[method-assign]
    body = {"model": MODEL, "prompt": "late", "max_tokens": 300, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.1))
    deadline = time.monotonic() + 10
    while not added:  # the engine thread is still adding it
        assert time.monotonic() < deadline
        time.sleep(0.02)
    served.wait_until_idle()  # aborted on the engine: nothing runs, every block free
    m = wait_until_metrics_idle(served.url, aborted=1)
    assert m[ABORTED] == 1
    assert m.get("specdec_request_finished_total{finish_reason=length}", 0) == 0


@pytest.mark.parametrize("concurrency", [1, 8])
def test_loadgen_reports_latency_figures(served, concurrency):
    config = LoadConfig(served.url, num_requests=16, concurrency=concurrency, stream_fraction=1.0)
    summary = asyncio.run(run_load(config)).summary()
    assert summary["requests_ok"] == 16
    assert 0 < summary["ttft_p50_ms"] <= summary["ttft_p99_ms"]
    assert 0 < summary["itl_p50_ms"] <= summary["itl_p99_ms"]
    assert summary["output_tokens_per_s"] > 0


@pytest.mark.parametrize("api", ["completions", "responses"])
def test_closing_an_openai_stream_aborts_its_request(served, api):
    before = scrape(served.url).get(ABORTED, 0)
    client, extra = served.client(), {"stream": True, "extra_body": {"ignore_eos": True}}
    if api == "completions":
        stream = client.completions.create(model=MODEL, prompt="cancel me", max_tokens=400, **extra)
        next(iter(stream))
    else:  # opened, and text on its way
        stream = client.responses.create(
            model=MODEL, input="cancel me", max_output_tokens=400, **extra
        )
        kinds = [next(iter(stream)).type for _ in range(5)]
        assert kinds[-1] == "response.output_text.delta"
    stream.close()
    m = wait_until_metrics_idle(served.url)
    assert m[ABORTED] - before == 1
    served.wait_until_idle()


def test_soak_passes_with_disconnects_and_nothing_left_over(make_server):
    served = make_server(num_kv_blocks=512)
    load = LoadConfig(served.url, num_requests=300, concurrency=48, max_tokens=24, model=MODEL)
    report = asyncio.run(soak.soak(soak.soak_config(load, disconnect_share=0.1)))
    assert report.passed, report.format()
    assert report.completed + report.disconnected == 300
    assert 10 < report.disconnected < 60 and report.aborted >= report.disconnected * 0.9
    assert 0 < report.ttft_p50_ms <= report.ttft_p99_ms
    served.wait_until_idle()


def test_soak_fails_on_lost_requests_and_server_errors(make_server):
    served = make_server()
    encode = served.llm.encode

    def flaky(prompt):
        if isinstance(prompt, str) and prompt.startswith("the"):
            raise RuntimeError("injected")
        return encode(prompt)

    served.llm.encode = flaky  # type: ignore[method-assign]
    load = LoadConfig(served.url, num_requests=40, concurrency=8, max_tokens=4, model=MODEL)
    report = asyncio.run(soak.soak(load))
    assert not report.passed and "FAIL" in report.format()
    assert report.lost > 0 and report.client_5xx == report.server_5xx == report.lost


def test_soak_command(served):
    args = ["--url", served.url, "--requests", "20", "--concurrency", "4", "--model", MODEL]
    result = CliRunner().invoke(soak.main, args)
    assert result.exit_code == 0, result.output
    assert "20 requests:" in result.output and "PASS" in result.output
    refused = CliRunner().invoke(soak.main, [*args, "--disconnect-fraction", "0.9"])
    assert refused.exit_code == 2 and "only streamed requests can hang up" in refused.output


def test_open_loop_arrivals_reach_a_running_server(served):
    """specdec bench --url: streamed chat requests sent at their arrival times, whatever is in
    flight; each complete, with its latencies counted from its arrival."""
    from specdec.eval.bench.load import arrival_times, run_over_http

    requests = [([{"role": "user", "content": f"hello {i}"}], 5) for i in range(6)]
    arrivals = arrival_times(50.0, len(requests), seed=1)
    report = run_over_http(served.url, requests, arrivals)
    assert report.errors == []
    summary = report.summary()
    assert summary["requests_ok"] == 6
    assert 0 < summary["ttft_p50_ms"] <= summary["ttft_p90_ms"] <= summary["ttft_p99_ms"]
    assert all(r.completion_tokens == 5 for r in report.records)
    assert report.duration_s >= arrivals[-1]
    served.wait_until_idle()
