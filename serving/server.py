"""Run an app with uvicorn in a background thread, on a loopback port the OS picks.

Used by the tests and by anything else that needs a live server inside one process::

    with BackgroundServer(build_app(llm)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from starlette.types import ASGIApp


class BackgroundServer:
    """A uvicorn server for ``app`` in a daemon thread; ``url`` is set once it listens."""

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        startup_timeout_s: float = 30.0,
    ):
        self.app = app
        self.host = host  # the address to bind: loopback by default
        self.port = port  # 0: any free port (the bound one is in `url`)
        self.startup_timeout_s = startup_timeout_s  # how long start() waits for the server
        config = uvicorn.Config(
            app, log_level=log_level, timeout_graceful_shutdown=5, access_log=False
        )
        self.server = uvicorn.Server(config)
        self.url = ""  # http://host:port once started
        self._thread: threading.Thread | None = None

    def start(self) -> BackgroundServer:
        # The protocol must be named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
        # sockets whose proto is IPPROTO_TCP, and with it on, every response that is written in
        # two parts (head, then body) waited ~40 ms for the client's delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        host, port = sock.getsockname()[:2]
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.01)
        self.url = f"http://{host}:{port}"
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shut the server down (its lifespan stops the engine thread) and wait for it."""
        if self._thread is not None:
            self.server.should_exit = True
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"the server did not stop within {timeout_s} s")

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
