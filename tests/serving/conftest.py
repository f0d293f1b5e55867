"""Live servers on loopback ports for the serving tests, on tiny random models."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from specdec import LLM
from specdec.serving import BackgroundServer, ServerConfig, build_app
from specdec.serving.app import ServerState
from tests.tiny import byte_tokenizer, tiny_model

MODEL = "tiny"  # the served model name


@dataclass
class Served:
    """A running server, its LLM and clients for it."""

    server: BackgroundServer
    llm: LLM
    api_key: str | None = None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def state(self) -> ServerState:
        return self.server.app.state.server  # type: ignore[attr-defined]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0
        )

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, timeout=30, **kwargs)

    def wait_until_idle(self, timeout_s: float = 10.0) -> None:
        """Wait until the engine has no request and every KV block is free."""
        engine = self.llm.engine
        deadline = time.monotonic() + timeout_s
        while engine.has_unfinished() or engine.num_free_blocks != engine.num_blocks:
            assert time.monotonic() < deadline, (
                f"engine not idle: {len(engine.scheduler.running)} running, "
                f"{len(engine.scheduler.waiting)} waiting, "
                f"{engine.num_blocks - engine.num_free_blocks} blocks in use"
            )
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.stop()
        assert not self.state.engine.is_running, "the engine thread outlived the server"
        assert not self.llm.engine.has_unfinished(), "requests left in the engine"
        assert self.llm.engine.num_free_blocks == self.llm.engine.num_blocks, "leaked KV blocks"


def start_server(config: ServerConfig | None = None, **llm_options) -> Served:
    llm_options.setdefault("num_kv_blocks", 256)
    llm = LLM(tiny_model("llama"), tokenizer=byte_tokenizer(), **llm_options)
    config = config or ServerConfig(served_model_name=MODEL)
    server = BackgroundServer(build_app(llm, config)).start()
    return Served(server, llm, config.api_key)


@pytest.fixture(scope="module")
def offline() -> LLM:
    """The served model (same weights), run offline as the reference."""
    return LLM(tiny_model("llama"), tokenizer=byte_tokenizer(), num_kv_blocks=64)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """One server shared by a test module; checked for leaks when the module is done."""
    served = start_server()
    yield served
    served.stop()


@pytest.fixture
def make_server() -> Iterator[Callable[..., Served]]:
    """Start servers with their own configuration; each is stopped and checked after the test."""
    started: list[Served] = []

    def make(config: ServerConfig | None = None, **llm_options) -> Served:
        started.append(start_server(config, **llm_options))
        return started[-1]

    yield make
    for served in started:
        served.stop()
