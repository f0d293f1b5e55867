"""specdec.serving: the OpenAI-compatible HTTP server behind ``specdec serve``.

``build_app(llm, ServerConfig(...))`` makes the FastAPI app; ``specdec serve`` runs it with
uvicorn; :class:`BackgroundServer` runs it in a thread (tests, benchmarks). ``loadgen`` is a load
generator for a running server: ``python -m specdec.serving.loadgen --url ...``.

Modules: ``app`` (config, state, middleware, lifespan), ``routes`` (the endpoints), ``protocol``
and ``responses`` (request and response bodies), ``generation`` (one request's sequences on the
engine), ``bridge`` (the engine thread), ``limits`` (API key, body size, admission), ``metrics``
(Prometheus), ``errors`` (OpenAI error bodies), ``server``, ``cli``, ``loadgen``.
"""

from specdec.serving.app import ServerConfig, build_app
from specdec.serving.server import BackgroundServer

__all__ = ["BackgroundServer", "ServerConfig", "build_app"]
