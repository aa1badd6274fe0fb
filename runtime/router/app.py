"""The router's HTTP face: the FastAPI app that hands generate routes to `Router.route` and fans the
rest out to one or all replicas, and `run_router`, which serves it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import FastAPI, Path, Request
from starlette.responses import Response

from ..server.http_common import ApiError, GuardMiddleware, add_error_handlers, bind_socket, json_response
from .router import GENERATE_PATHS, Router, label_metrics, plain_response


def create_router_app(router: Router, api_key: str | None = None, ready_message: str | None = None) -> FastAPI:
    """The router's FastAPI app. `api_key` is the router's own key (every route but /health)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        task = asyncio.create_task(router.health_loop())
        if ready_message:
            print(ready_message, flush=True)
        try:
            yield
        finally:
            task.cancel()
            await router.stop()

    app = FastAPI(title="plait router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    for path in GENERATE_PATHS:
        app.add_api_route(path, _generate_handler(router, path), methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        if not router.healthy():
            return router.no_replica_error().response()
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        return await router.any_replica(request, "GET", "/health_generate")

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info(request: Request) -> Response:
        return await router.any_replica(request, "GET", "/get_model_info")

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str = Path(pattern=r"^resp_[0-9a-f]+$")) -> Response:
        return await router.get_response(request, response_id)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.any_replica(request, "GET", "/v1/models")

    def any_replica(path: str) -> Callable:
        async def forward(request: Request) -> Response:
            return await router.any_replica(request, "POST", path)

        return forward

    for path in ("/tokenize", "/detokenize"):  # the same tokenizer on every replica
        app.add_api_route(path, any_replica(path), methods=["POST"])

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info(request: Request) -> Response:
        return json_response(await router.server_info(request))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        answers = await router.all_replicas(request, request.method, "/flush_cache")
        for replica, a in answers:
            if not isinstance(a, httpx.Response):
                raise ApiError(502, f"replica {replica.url} did not answer /flush_cache: {a}")
            if a.status_code != 200:
                return plain_response(a, a.content)
        return json_response({"success": True, "message": f"cache flushed on {len(answers)} replica(s)"})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        # The router does not keep rids; the replica that holds it aborts it, the others ignore it.
        answers = await router.all_replicas(request, "POST", "/abort_request")
        found = any(
            isinstance(a, httpx.Response) and a.status_code == 200 and a.json().get("found") for _, a in answers
        )
        bad = next((a for _, a in answers if isinstance(a, httpx.Response) and a.status_code != 200), None)
        if bad is not None:
            return plain_response(bad, bad.content)
        return json_response({"success": True, "found": found})

    @app.post("/concate_and_append_request")
    async def concate_and_append_request() -> Response:
        return json_response({"success": True})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        lines = [router.metrics.render(list(router.replicas.values())).decode()]
        seen: set[str] = set()
        for replica, a in await router._gather_healthy(request, "/metrics"):
            if isinstance(a, httpx.Response) and a.status_code == 200:
                lines += label_metrics(a.text, replica.url, seen)
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    add_error_handlers(app, "router")
    app.add_middleware(GuardMiddleware, api_key=api_key)
    return app


def _generate_handler(router: Router, path: str) -> Callable:
    async def handler(request: Request) -> Response:
        return await router.route(request, path)

    handler.__name__ = "route_" + path.strip("/").replace("/", "_")
    return handler


def run_router(
    router: Router,
    host: str,
    port: int,
    api_key: str | None = None,
    sock: socket.socket | None = None,
    log_level: str = "warning",
    ready_message: str | None = None,
) -> None:
    """Serve the router until SIGINT / SIGTERM."""
    import uvicorn

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    sock = sock or bind_socket(host, port)
    try:
        shown = f"[{host}]" if ":" in host else host
        app = create_router_app(
            router,
            api_key,
            ready_message
            or f"plait: router ready ({router.policy.name}, {len(router.replicas)} "
            f"replica(s)) at http://{shown}:{port}",
        )
        config = uvicorn.Config(app, log_level=log_level.lower(), access_log=False, timeout_graceful_shutdown=3)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
