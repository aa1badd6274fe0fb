"""HTTP pieces the API server and the data-parallel router share: OpenAI-shaped errors, strict
JSON and SSE, reading a request body within limits, the API-key and size guard, error handlers,
binding the listening socket.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import socket
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ..output_check import INVALID_OUTPUT

logger = logging.getLogger("plait.http")

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_JSON_DEPTH = 64  # nesting of the request body (a JSON schema inside included)
RETRY_AFTER_S = 1
SSE_DONE = "data: [DONE]\n\n"
# path -> `endpoint` label of the requests counter
GENERATE_ENDPOINTS = {
    "/generate": "generate",
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
}

_ERROR_DEFAULTS = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "request_timeout"),
}
# Abort messages of an engine that can no longer serve (scheduler_client.py): 503, not the client's fault.
_UNAVAILABLE_MARKERS = ("shut down", "died unexpectedly", "process failed", "receiver failed")


# --- errors -----------------------------------------------------------------------------------
class ApiError(Exception):
    """An error answered to the client as `{"error": {...}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        default_type, default_code = _ERROR_DEFAULTS.get(status, ("invalid_request_error", str(status)))
        self.status = status
        self.message = message
        self.type = type_ or default_type
        self.code = code or default_code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The error object sent to the client."""
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}

    def response(self) -> Response:
        """The error as an HTTP response."""
        return json_response(self.body(), self.status, self.headers)


class ClientGone(Exception):
    """The client disconnected while its request was running; nothing is sent back."""


def abort_error(reason: dict[str, Any]) -> ApiError:
    """The error for a request the engine ended with `{"type": "abort"}` without being asked to."""
    message = str(reason.get("message") or "the request was aborted")
    if message.startswith(("internal error", INVALID_OUTPUT)):  # ours, not the caller's
        return ApiError(500, message)
    if any(m in message for m in _UNAVAILABLE_MARKERS):
        return ApiError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})
    return ApiError(400, message)


def is_abort(result: dict[str, Any]) -> bool:
    """Whether a result ended with finish reason `abort`."""
    reason = (result.get("meta_info") or {}).get("finish_reason")
    return isinstance(reason, dict) and reason.get("type") == "abort"


# --- JSON and SSE -----------------------------------------------------------------------------
def dumps(obj: Any) -> str:
    """Strict JSON; a non-finite float (a -inf logprob) becomes -9999.0 / null as in OpenAI's API."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, default=str)
    except ValueError:
        return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False, default=str)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else (-9999.0 if obj < 0 else 9999.0)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response encoded with `dumps`."""
    return Response(dumps(obj), status_code=status, headers=headers, media_type="application/json")


def sse(obj: Any) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {dumps(obj)}\n\n"


def _is_json_type(content_type: str | None) -> bool:
    """No Content-Type (curl, raw clients) or a JSON one; anything else is a client mistake."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media in ("application/json", "*/*") or media.endswith("+json")


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        depth = max(depth, d)
        if d <= MAX_JSON_DEPTH:  # no need to look deeper than the limit
            stack.extend((x, d + 1) for x in v)
    return depth


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object; 415 for a non-JSON Content-Type, 413 past MAX_BODY_BYTES
    (also for chunked bodies), 400 if it is not a JSON object or nests deeper than MAX_JSON_DEPTH."""
    body = bytearray()
    async for chunk in request.stream():  # read even a body we refuse, so the connection stays usable
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    if not _is_json_type(request.headers.get("content-type")):
        raise ApiError(
            415,
            f"Content-Type must be application/json, got {request.headers['content-type']!r} "
            "(with curl, add -H 'Content-Type: application/json')",
        )
    if not body.strip():
        raise ApiError(400, "the request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # nested deeper than the parser goes
        raise ApiError(
            400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        ) from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


# --- middleware -------------------------------------------------------------------------------
class GuardMiddleware:
    """API-key check (every route but /health) and Content-Length limit, before any handler runs.

    A plain ASGI middleware, not BaseHTTPMiddleware, so streaming and disconnects pass through."""

    def __init__(self, app: Callable, api_key: str | None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            err = self._check(scope)
            if err is not None:
                if scope.get("path", "").startswith("/v1/messages"):  # Anthropic's clients read their own shape
                    from .anthropic_api import error_response

                    await error_response(err)(scope, receive, send)
                else:
                    await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: dict) -> ApiError | None:
        headers = Headers(scope=scope)
        if self.api_key is not None and scope.get("path") != "/health":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer":
                token = headers.get("x-api-key", "")  # Anthropic's header
            if not hmac.compare_digest(token.strip().encode(), self.api_key):
                return ApiError(
                    401, "missing or invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
                )
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                return ApiError(400, f"invalid Content-Length header {length!r}")
            if int(length) > MAX_BODY_BYTES:
                return ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        return None


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


# --- app --------------------------------------------------------------------------------------
def add_error_handlers(app: FastAPI, what: str = "server") -> None:
    """Every error in the OpenAI shape: ours, FastAPI's validation (400, not 422), routing (404 /
    405), client disconnects, and anything unexpected (500, logged, no traceback sent). Used by
    the server and by the router (`what` names it in a 500's message)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        endpoint = GENERATE_ENDPOINTS.get(request.url.path)
        state = getattr(request.app.state, "plait", None)  # the router keeps no such state
        if endpoint is not None and state is not None:
            state.metrics.count_request(endpoint, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        parts = ["/".join(str(p) for p in e.get("loc", ())) + ": " + str(e.get("msg")) for e in exc.errors()]
        return ApiError(400, "invalid request: " + "; ".join(parts)).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})).response()

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        # Starlette re-raises after answering, so the server log gets the traceback; the client never.
        logger.error("unhandled error on %s %s: %r", request.method, request.url.path, exc)
        return ApiError(500, f"internal {what} error ({type(exc).__name__})").response()


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; OSError (EADDRINUSE) if the port is taken. Bound before the
    model loads so that a busy port fails fast."""
    family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock  # not inheritable: the engine's spawned scheduler process must not hold the port
