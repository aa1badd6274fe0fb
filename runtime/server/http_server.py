"""The HTTP server over one `Engine`: the app (native API in `native_api.py`, OpenAI-compatible
API in `openai_api.py`, health, metrics, errors), start-up, the periodic load line and draining on
SIGTERM.

Everything that is not a 200 is an OpenAI-shaped error object
`{"error": {"message", "type", "code"}}`; no traceback ever reaches a client. Each generate
request gets engine request ids (rids) so that a client that goes away can be aborted, which
releases its KV memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import threading
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI

from ..server_args import ServerArgs
from .api_schema import add_components
from .http_common import GuardMiddleware, add_error_handlers, bind_socket
from .metrics import cache_hit_rate, kv_usage
from .native_api import add_native_routes
from .server_state import ServerState

logger = logging.getLogger("plait.http")


DEFAULT_MAX_QUEUED_REQUESTS = 1024
DRAIN_TIMEOUT_S = 5.0  # on SIGTERM: how long running requests may finish before they fail
LOG_INTERVAL_S = 10.0  # periodic load line while busy


async def _log_loop(state: ServerState, interval: float) -> None:
    """Every `interval` seconds while busy: running / queued requests, KV usage, generation
    throughput, cache hit rate."""
    last_gen, last_t = None, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        try:
            info = await asyncio.to_thread(state.engine.get_server_info)
        except Exception:
            continue
        now, gen = time.monotonic(), info.get("num_generated_tokens", 0)
        rate = (gen - last_gen) / (now - last_t) if last_gen is not None else 0.0
        last_gen, last_t = gen, now
        if info.get("num_running", 0) or info.get("num_waiting", 0) or state.in_flight or rate:
            logger.info(
                "running: %d, queued: %d, http in flight: %d, KV usage: %.1f%%, gen throughput: "
                "%.1f tok/s, cache hit rate: %.1f%%",
                info.get("num_running", 0),
                info.get("num_waiting", 0),
                state.in_flight,
                100 * kv_usage(info),
                rate,
                100 * cache_hit_rate(info),
            )


def create_app(
    engine: Any,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    ready_message: str | None = None,
    log_interval: float = LOG_INTERVAL_S,
    request_timeout: float | None = None,
    log_requests: bool = False,
) -> FastAPI:
    """The FastAPI app serving `engine` (which the caller owns and shuts down).

    `served_model_name` is the name in /v1/models and the accepted `model` (besides the model
    path); `max_queued_requests` bounds the generate requests in flight (503 beyond);
    `request_timeout` (seconds) fails and aborts a generate request that runs longer (504);
    `log_requests` logs request bodies (prompts); `ready_message` is printed once the server is up.
    The OpenAPI description is at /openapi.json (behind the API key like every route but /health)."""
    from .anthropic_api import add_anthropic_routes
    from .embeddings_api import add_embeddings_routes
    from .openai_api import add_openai_routes
    from .responses_api import add_responses_routes
    from .tokenize_api import add_tokenize_routes

    if request_timeout is not None and not request_timeout > 0:
        raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
    state = ServerState(
        engine, served_model_name or str(engine.args.model), max_queued_requests, request_timeout, log_requests
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_log_loop(state, log_interval))
        if ready_message:
            print(ready_message, flush=True)
        try:
            yield
        finally:
            task.cancel()

    from plait import __version__

    app = FastAPI(
        title="plait",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.plait = state
    add_error_handlers(app)
    add_native_routes(app, state)
    add_openai_routes(app, state)
    add_tokenize_routes(app, state)
    add_anthropic_routes(app, state)
    add_responses_routes(app, state)
    add_embeddings_routes(app, state)
    app.add_middleware(GuardMiddleware, api_key=api_key)
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = add_components(default_openapi())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


async def drain(state: ServerState, timeout: float) -> None:
    """Shutting down: refuse new generate requests (503), give running ones up to `timeout` seconds
    to finish, then shut the engine down so that those still running end with a 503 error (a
    clear answer, not a cut connection) rather than being cancelled."""
    state.draining = True
    deadline = time.monotonic() + timeout
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not state.in_flight:
        return
    logger.warning("%d request(s) still running after %g s; failing them", state.in_flight, timeout)
    await asyncio.to_thread(state.engine.shutdown)
    deadline = time.monotonic() + 2.0  # let their handlers send the error
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def _draining_server(config: Any, state: ServerState, drain_timeout: float) -> Any:
    """A uvicorn server that drains (`drain`) before its own graceful shutdown, and after a
    SIGTERM / SIGINT exits normally instead of re-raising the signal (uvicorn's default, which
    would kill the process before the engine is shut down)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await drain(state, drain_timeout)
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            with super().capture_signals():
                yield
                self._captured_signals.clear()  # handled: we drained and exit on our own

    return DrainingServer(config)


def run_server(
    args: ServerArgs,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | None = None,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    served_model_name: str | None = None,
    sock: socket.socket | None = None,
    request_timeout: float | None = None,
    log_requests: bool = False,
    drain_timeout: float = DRAIN_TIMEOUT_S,
) -> None:
    """Load the engine and serve until SIGINT / SIGTERM (drained, see `drain`); the engine is shut
    down on the way out. Raises SystemExit(1) if the engine's processes died."""
    import uvicorn

    from ..engine import Engine

    sock = sock or bind_socket(host, port)
    engine = Engine(**dataclasses.asdict(args))
    died = threading.Event()
    try:
        shown = f"[{host}]" if ":" in host else host
        app = create_app(
            engine,
            api_key,
            served_model_name,
            max_queued_requests,
            ready_message=f"plait: ready, serving {args.model} at http://{shown}:{port}",
            request_timeout=request_timeout,
            log_requests=log_requests,
        )
        config = uvicorn.Config(app, log_level=args.log_level.lower(), access_log=False, timeout_graceful_shutdown=3)
        server = _draining_server(config, app.state.plait, drain_timeout)
        threading.Thread(target=_watch_engine, args=(engine, server, died), name="plait-watchdog", daemon=True).start()
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    if died.is_set():
        raise SystemExit(1)


def _watch_engine(engine, server, died: threading.Event, period_s: float = 0.5) -> None:
    """A server whose scheduler process died can only fail requests: log why and stop (exit 1)
    rather than linger half-alive."""
    while not server.should_exit:
        if engine.failure is not None:
            logger.error("plait: %s; shutting the server down", engine.failure)
            died.set()
            server.should_exit = True
            return
        time.sleep(period_s)
