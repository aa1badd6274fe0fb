"""The HTTP server over one `Engine`: the native SGLang-compatible API (`shared/protocol.md`),
the OpenAI-compatible API (`openai_api.py`), health, metrics and errors.

Everything that is not a 200 is an OpenAI-shaped error object
`{"error": {"message", "type", "code"}}`; no traceback ever reaches a client. Each generate
request gets engine request ids (rids) so that a client that goes away can be aborted, which
releases its KV memory.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import socket
import threading
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

from .api_schema import (MAX_NATIVE_TOP_LOGPROBS, AbortRequest, GenerateRequest, GenerateResult, add_components,
                         json_body, ref, responses)
from ..output_check import INVALID_OUTPUT
from ..sampling_params import MAX_INT, MAX_N
from ..server_args import ServerArgs
from .metrics import METRICS_CONTENT_TYPE, ServerMetrics, StreamTimer, cache_hit_rate, kv_usage

logger = logging.getLogger("plait.http")

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_JSON_DEPTH = 64              # nesting of the request body (a JSON schema inside included)
MAX_SEQS_PER_REQUEST = 1024      # prompts x n of one request
DEFAULT_MAX_QUEUED_REQUESTS = 1024
DRAIN_TIMEOUT_S = 5.0            # on SIGTERM: how long running requests may finish before they fail
LOGGED_BODY_CHARS = 2000         # --log-requests: a request body is cut to this length
LOG_INTERVAL_S = 10.0            # periodic load line while busy
HEALTH_GENERATE_TIMEOUT_S = 30.0
FLUSH_WAIT_S = 5.0               # /flush_cache waits this long for running requests to end
RETRY_AFTER_S = 1
SSE_DONE = "data: [DONE]\n\n"
# path -> `endpoint` label of the requests counter
GENERATE_ENDPOINTS = {"/generate": "generate", "/v1/completions": "completions", "/v1/chat/completions": "chat",
                      "/v1/responses": "responses", "/v1/embeddings": "embeddings"}

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

    def __init__(self, status: int, message: str, type_: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
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
    if message.startswith(("internal error", INVALID_OUTPUT)):   # ours, not the caller's
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
        if d <= MAX_JSON_DEPTH:   # no need to look deeper than the limit
            stack.extend((x, d + 1) for x in v)
    return depth


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object; 415 for a non-JSON Content-Type, 413 past MAX_BODY_BYTES
    (also for chunked bodies), 400 if it is not a JSON object or nests deeper than MAX_JSON_DEPTH."""
    body = bytearray()
    async for chunk in request.stream():   # read even a body we refuse, so the connection stays usable
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    if not _is_json_type(request.headers.get("content-type")):
        raise ApiError(415, f"Content-Type must be application/json, got {request.headers['content-type']!r} "
                       "(with curl, add -H 'Content-Type: application/json')")
    if not body.strip():
        raise ApiError(400, "the request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:   # nested deeper than the parser goes
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_json")
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
                if scope.get("path", "").startswith("/v1/messages"):   # Anthropic's clients read their own shape
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
                token = headers.get("x-api-key", "")       # Anthropic's header
            if not hmac.compare_digest(token.strip().encode(), self.api_key):
                return ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                                     "(or 'x-api-key: <key>')")
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                return ApiError(400, f"invalid Content-Length header {length!r}")
            if int(length) > MAX_BODY_BYTES:
                return ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        return None


# --- per-request bookkeeping ------------------------------------------------------------------
class Hold:
    """One admitted generate request: its place in the server's bound and its engine rids.

    `close()` gives the place back and aborts every rid not seen finished (a no-op in the engine
    for finished ones), so a failure or a disconnect never leaves KV memory held."""

    def __init__(self, state: "ServerState", rids: list[str], aliases: dict[str, list[str]]):
        self.state = state
        self.rids = rids
        self.aliases = aliases
        self.done: set[str] = set()
        self.start = time.perf_counter()
        # --request-timeout: past this (time.monotonic()) the request fails with 504 and is aborted
        self.deadline = time.monotonic() + state.request_timeout if state.request_timeout else None
        self.closed = False

    def finish(self, rid: str) -> None:
        """Mark one rid finished (no abort needed at close)."""
        self.done.add(rid)

    def finish_all(self) -> None:
        """Mark every rid finished."""
        self.done.update(self.rids)

    def close(self) -> None:
        """Release the place; abort unfinished rids. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.state.in_flight -= 1
        for rid in self.rids:
            if rid not in self.done:
                with contextlib.suppress(Exception):   # e.g. an engine already shut down
                    self.state.engine.abort(rid)
            self.state.active.pop(rid, None)
            self.state.user_aborted.discard(rid)
        for name in self.aliases:
            self.state.aliases.pop(name, None)

    def __enter__(self) -> "Hold":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ServerState:
    """What the route handlers share: the engine, names, the request bound, limits, metrics."""

    def __init__(self, engine: Any, served_model_name: str, max_queued_requests: int,
                 request_timeout: float | None = None, log_requests: bool = False):
        self.engine = engine
        self.served_model_name = served_model_name
        self.model_path = str(engine.args.model)
        self.max_queued_requests = max_queued_requests
        self.request_timeout = request_timeout
        self.log_requests = log_requests
        self.draining = False                   # shutting down: new generate requests get 503
        self.in_flight = 0
        self.active: dict[str, Hold] = {}       # engine rid -> its request
        self.aliases: dict[str, list[str]] = {}  # a client-visible id -> its engine rids (n copies)
        self.user_aborted: set[str] = set()     # rids aborted on purpose: their result is not an error
        self.metrics = ServerMetrics()
        # Read once: the context length bounds OpenAI's default max_tokens.
        self.context_len: int | None = engine.get_server_info().get("context_length")

    @property
    def model_names(self) -> set[str]:
        """Names a client may put in `model`."""
        return {self.served_model_name, self.model_path}

    def check_model(self, body: dict[str, Any]) -> None:
        """404 `model_not_found` for a `model` this server does not serve (absent is fine)."""
        model = body.get("model")
        if model is None:
            return
        if not isinstance(model, str):
            raise ApiError(400, f"model must be a string, got {type(model).__name__}")
        if model not in self.model_names:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.served_model_name!r}", code="model_not_found")

    def admit(self, rids: list[str], aliases: dict[str, list[str]] | None = None) -> Hold:
        """Take a place for a generate request, or 503 with Retry-After past the bound (or while
        shutting down, or when the engine is dead). `aliases` are ids a client may pass to
        /abort_request to abort several engine rids at once."""
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if self.draining:
            raise ApiError(503, "the server is shutting down", headers=retry)
        failure = getattr(self.engine, "failure", None)
        if failure is not None:
            raise ApiError(503, f"the engine cannot serve: {failure}", headers=retry)
        if len(rids) > MAX_SEQS_PER_REQUEST:
            raise ApiError(400, f"a request may ask for at most {MAX_SEQS_PER_REQUEST} sequences (prompts x n), "
                           f"got {len(rids)}")
        if self.in_flight >= self.max_queued_requests:
            raise ApiError(503, f"the server is at its limit of {self.max_queued_requests} requests in "
                           "flight; retry later", code="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        aliases = aliases or {}
        for rid in [*rids, *aliases]:
            if rid in self.active or rid in self.aliases:
                raise ApiError(400, f"rid {rid!r} is already in use by a running request")
        self.in_flight += 1
        hold = Hold(self, rids, aliases)
        for rid in rids:
            self.active[rid] = hold
        self.aliases.update(aliases)
        return hold

    def abort_request(self, rid: str) -> bool:
        """Abort on purpose (from /abort_request): the request and its n copies end with `abort`."""
        rids = self.aliases.get(rid) or ([rid] if rid in self.active else [])
        for r in rids:
            self.user_aborted.add(r)
            self.engine.abort(r)
        if not rids:
            self.engine.abort(rid)   # may not have reached the server's books; harmless if unknown
        return bool(rids)

    def check_result(self, result: dict[str, Any]) -> None:
        """Raise the error for an abort nobody asked for."""
        if is_abort(result) and result["meta_info"].get("id") not in self.user_aborted:
            raise abort_error(result["meta_info"]["finish_reason"])

    def log_request(self, path: str, body: dict[str, Any]) -> None:
        """--log-requests: log the body (prompts included, cut to LOGGED_BODY_CHARS); off by default,
        so prompts never reach the log unless the operator asks."""
        if self.log_requests:
            text = dumps(body)
            cut = text[:LOGGED_BODY_CHARS] + ("..." if len(text) > LOGGED_BODY_CHARS else "")
            logger.info("request %s: %s", path, cut)

    def timeout_error(self) -> ApiError:
        """The error of a request past --request-timeout."""
        return ApiError(504, f"the request took longer than the server's limit of {self.request_timeout:g} s "
                        "and was aborted", code="request_timeout")

    async def next_result(self, hold: Hold, it: AsyncIterator[Any]) -> Any:
        """`it.__anext__()` within the request's deadline (504 past it)."""
        if hold.deadline is None:
            return await it.__anext__()
        try:
            return await asyncio.wait_for(it.__anext__(), max(hold.deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:
            raise self.timeout_error() from None

    async def watch(self, request: Request, aw: Awaitable[Any], hold: Hold | None = None) -> Any:
        """Await `aw`, raising ClientGone if the client disconnects first, and 504 past the hold's
        deadline (the caller's Hold then aborts the request). The body has been read, so the next
        ASGI message is the disconnect."""
        task = asyncio.ensure_future(aw)
        gone = asyncio.ensure_future(_wait_disconnect(request))
        deadline = hold.deadline if hold is not None else None
        timeout = max(deadline - time.monotonic(), 0) if deadline is not None else None
        try:
            await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            if not gone.done():
                raise self.timeout_error()
            raise ClientGone()
        finally:
            for t in (task, gone):
                if not t.done():
                    t.cancel()

    async def generate(self, request: Request, hold: Hold, endpoint: str, **kwargs: Any) -> Any:
        """Non-streaming engine call: results (checked for aborts), metrics, disconnect watch."""
        try:
            out = await self.watch(request, self.engine.async_generate(**kwargs, strict=False), hold)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except RuntimeError as e:
            raise self._unavailable(e) from None
        hold.finish_all()
        results = out if isinstance(out, list) else [out]
        for r in results:
            self.check_result(r)
        for r in results:
            self.metrics.observe_result(r, hold.start)
        self.metrics.count_request(endpoint, 200)
        return out

    def _unavailable(self, e: RuntimeError) -> Exception:
        """503 when the engine is shut down or its processes died; any other error stays a bug (500)."""
        if getattr(self.engine, "failure", None) is not None or "shut down" in str(e):
            return ApiError(503, str(e), headers={"Retry-After": str(RETRY_AFTER_S)})
        return e

    async def open_stream(self, rid: str, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """Start one streaming engine call; 400 for bad input."""
        try:
            return await self.engine.async_generate(**kwargs, stream=True, rid=rid, strict=False)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except RuntimeError as e:
            raise self._unavailable(e) from None

    async def server_info(self) -> dict[str, Any]:
        """engine.get_server_info() (off the event loop) plus the server's own state."""
        from plait import __version__
        info = await asyncio.to_thread(self.engine.get_server_info)
        if "max_total_num_tokens" in info:   # held by running requests: neither free nor cached
            info["kv_slots_in_use"] = info["max_total_num_tokens"] - info.get("free_slots", 0) - \
                info.get("cache_size", 0)
        for name in ("scheduler_pid", "detokenizer_pid"):   # for operators (and fault-injection tests)
            pid = getattr(self.engine, name, None)
            if isinstance(pid, int):
                info[name] = pid
        return {**info, "version": __version__, "served_model_name": self.served_model_name,
                "model_path": self.model_path, "max_queued_requests": self.max_queued_requests,
                "num_http_in_flight": self.in_flight}


class EventStream(StreamingResponse):
    """An SSE response that releases its request however it ends: finished, failed, or the client
    gone (also before the body generator ever started, when its own cleanup would not run)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], hold: Hold):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.hold = hold

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.hold.close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


# --- native API -------------------------------------------------------------------------------
@dataclasses.dataclass
class NativeRequest:
    """A parsed `POST /generate` body."""
    kwargs: dict[str, Any]          # for engine.async_generate, without rid/stream
    item_rids: list[str]            # one per prompt
    n_per_item: list[int]
    stream: bool
    batch: bool                     # the answer is a list


def _type_error(field: str, expected: str, value: Any) -> ApiError:
    return ApiError(400, f"{field} must be {expected}, got {type(value).__name__}")


def _opt(body: dict[str, Any], field: str, default: Any, check: Callable[[Any], bool], expected: str) -> Any:
    value = body.get(field)
    if value is None:
        return default
    if not check(value):
        raise _type_error(field, expected, value)
    return value


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def _prompt_fields(body: dict[str, Any]) -> tuple[dict[str, Any], int, bool]:
    """text / input_ids -> engine kwargs, number of prompts, whether it is a batch."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError(400, "give exactly one of text and input_ids")
    if text is not None:
        if isinstance(text, str):
            return {"prompt": text}, 1, False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return {"prompt": text}, len(text), True
        raise ApiError(400, "text must be a string or a non-empty list of strings")
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        return {"input_ids": ids}, len(ids), True
    if isinstance(ids, list) and all(is_int(x) for x in ids):
        return {"input_ids": ids}, 1, False
    raise ApiError(400, "input_ids must be a list of ints or a non-empty list of lists of ints")


def _n_of(params: Any) -> int:
    n = params.get("n") if isinstance(params, dict) else None
    return n if is_int(n) and n > 0 else 1


def parse_native(body: dict[str, Any]) -> NativeRequest:
    """Validate the top-level fields of a /generate body (the engine validates sampling params)."""
    kwargs, num, batch = _prompt_fields(body)
    sp = body.get("sampling_params")
    if sp is not None and not isinstance(sp, (dict, list)):
        raise _type_error("sampling_params", "an object or a list of objects", sp)
    if isinstance(sp, list) and not all(p is None or isinstance(p, dict) for p in sp):
        raise ApiError(400, "sampling_params must be an object or a list of objects")
    if isinstance(sp, list) and len(sp) != num:
        raise ApiError(400, f"sampling_params has {len(sp)} entries for {num} prompt(s)")
    kwargs["sampling_params"] = sp
    kwargs["return_logprob"] = _opt(body, "return_logprob", False, lambda v: isinstance(v, bool), "a bool")
    kwargs["logprob_start_len"] = _opt(body, "logprob_start_len", -1, is_int, "an int")
    kwargs["top_logprobs_num"] = _opt(body, "top_logprobs_num", 0, is_int, "an int")
    if not 0 <= kwargs["top_logprobs_num"] <= MAX_NATIVE_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs_num must be in [0, {MAX_NATIVE_TOP_LOGPROBS}], "
                       f"got {kwargs['top_logprobs_num']}")
    if not -1 <= kwargs["logprob_start_len"] <= MAX_INT:
        raise ApiError(400, f"logprob_start_len must be >= -1, got {kwargs['logprob_start_len']}")
    kwargs["return_text_in_logprobs"] = _opt(body, "return_text_in_logprobs", False,
                                             lambda v: isinstance(v, bool), "a bool")
    stream = _opt(body, "stream", False, lambda v: isinstance(v, bool), "a bool")
    n_per_item = [_n_of(p) for p in sp] if isinstance(sp, list) else [_n_of(sp)] * num
    if sum(n_per_item) > MAX_SEQS_PER_REQUEST or max(n_per_item, default=1) > MAX_N:
        raise ApiError(400, f"a request may ask for at most {MAX_SEQS_PER_REQUEST} sequences (prompts x n) "
                       f"and n <= {MAX_N}")
    item_rids = _item_rids(body.get("rid"), num, batch)
    if not batch and n_per_item[0] > 1 and not stream:
        # n > 1 answers a list even for one prompt: send it as a batch of one
        for key in ("prompt", "input_ids"):
            if key in kwargs:
                kwargs[key] = [kwargs[key]]
        batch = True
    return NativeRequest(kwargs, item_rids, n_per_item, stream, batch)


def _item_rids(rid: Any, num: int, batch: bool) -> list[str]:
    if rid is None:
        base = uuid.uuid4().hex
        return [f"{base}-{j}" for j in range(num)] if batch else [base]
    if isinstance(rid, str) and not batch:
        return [rid]
    if isinstance(rid, list) and len(rid) == num and all(isinstance(r, str) and r for r in rid):
        if len(set(rid)) != num:
            raise ApiError(400, "rid must not repeat an id")
        return rid
    raise ApiError(400, "rid must be a string for one prompt, or a list of strings with one per prompt")


def expand_rids(item_rids: list[str], n_per_item: list[int]) -> list[str]:
    """The engine's rids: an item's rid as is when n == 1, else `rid-0` ... `rid-(n-1)`."""
    out: list[str] = []
    for rid, n in zip(item_rids, n_per_item):
        out += [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
    return out


async def handle_generate(state: ServerState, request: Request) -> Response:
    """POST /generate."""
    body = await read_json(request)
    state.log_request("/generate", body)
    req = parse_native(body)
    rids = expand_rids(req.item_rids, req.n_per_item)
    aliases = {r: expand_rids([r], [n]) for r, n in zip(req.item_rids, req.n_per_item) if n > 1}
    hold = state.admit(rids, aliases)
    if req.stream:
        return await _native_stream(state, request, hold, req)
    with hold:
        rid = req.item_rids if req.batch else req.item_rids[0]
        out = await state.generate(request, hold, "generate", rid=rid, **req.kwargs)
    return json_response(out)


async def _native_stream(state: ServerState, request: Request, hold: Hold, req: NativeRequest) -> Response:
    # The first result is awaited before answering, so bad input the engine reports late is
    # still a plain 400 rather than an error event.
    try:
        if req.batch or req.n_per_item[0] != 1:
            raise ApiError(400, "stream=true takes one prompt with n=1")
        rid = req.item_rids[0]
        it = await state.open_stream(rid, **req.kwargs)
        try:
            first = await state.watch(request, it.__anext__(), hold)
        except StopAsyncIteration:
            raise ApiError(500, "the engine ended the stream without a result") from None
        state.check_result(first)
    except BaseException:
        hold.close()
        raise
    return EventStream(_native_events(state, hold, rid, first, it), hold)


async def _native_events(state: ServerState, hold: Hold, rid: str, first: dict[str, Any],
                         it: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    timer = StreamTimer(state.metrics, hold.start)
    result = first
    try:
        while True:
            timer.update(result)
            meta = result["meta_info"]
            if is_abort(result) and meta.get("id") not in state.user_aborted:
                yield sse(abort_error(meta["finish_reason"]).body())
                break
            yield sse(result)
            if meta.get("finish_reason") is not None:
                hold.finish(rid)
                state.metrics.observe_result(result, hold.start)
                break
            result = await state.next_result(hold, it)
        state.metrics.count_request("generate", 200)
    except StopAsyncIteration:
        pass
    except ApiError as e:   # past --request-timeout
        hold.close()   # abort before the client hears of it
        yield sse(e.body())
    except Exception:
        logger.exception("stream %s failed", rid)
        hold.close()
        yield sse(ApiError(500, "internal error while streaming").body())
    yield SSE_DONE


def _model_info(state: ServerState) -> dict[str, Any]:
    return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
            "served_model_name": state.served_model_name, "context_length": state.context_len}


async def _flush(state: ServerState) -> Response:
    deadline = time.monotonic() + FLUSH_WAIT_S
    while True:
        if await asyncio.to_thread(state.engine.flush_cache):
            return json_response({"success": True, "message": "cache flushed"})
        if time.monotonic() > deadline:
            raise ApiError(503, "the cache was not flushed: requests are still running; retry when idle",
                           code="cache_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
        await asyncio.sleep(0.05)


async def _health_generate(state: ServerState) -> Response:
    rid = f"health-{uuid.uuid4().hex}"
    try:
        out = await asyncio.wait_for(state.engine.async_generate(
            prompt="Hello", sampling_params={"max_new_tokens": 1, "temperature": 0}, rid=rid, strict=False),
            HEALTH_GENERATE_TIMEOUT_S)
    except Exception as e:   # timeout, shutdown: unhealthy, whatever the cause
        state.engine.abort(rid)
        raise ApiError(503, f"the engine could not generate: {type(e).__name__}: {e}") from None
    if is_abort(out):
        raise ApiError(503, f"the engine could not generate: {out['meta_info']['finish_reason']}")
    return json_response({"status": "ok"})


def add_native_routes(app: FastAPI, state: ServerState) -> None:
    """The SGLang-compatible routes of protocol.md."""

    ok_json = responses({"type": "object"})

    @app.post("/generate", openapi_extra=json_body(GenerateRequest), responses=responses(
        {"anyOf": [ref(GenerateResult), {"type": "array", "items": ref(GenerateResult)}]}, stream=True))
    async def generate(request: Request) -> Response:
        return await handle_generate(state, request)

    @app.get("/get_model_info", responses=ok_json)
    @app.get("/model_info", responses=ok_json)
    async def model_info() -> Response:
        return json_response(_model_info(state))

    @app.get("/get_server_info", responses=ok_json)
    @app.get("/server_info", responses=ok_json)
    async def server_info() -> Response:
        return json_response(await state.server_info())

    @app.post("/flush_cache", responses=ok_json)
    async def flush_cache() -> Response:
        return await _flush(state)

    @app.get("/flush_cache", responses=ok_json)
    async def flush_cache_get() -> Response:   # SGLang accepts both methods
        return await _flush(state)

    @app.post("/concate_and_append_request", responses=ok_json)
    async def concate_and_append_request() -> Response:
        # The client has already joined the text; answering (not 404) keeps it from hanging.
        return json_response({"success": True})

    @app.get("/health", response_class=Response, responses={200: {"description": "healthy (empty body)"},
                                   503: responses()[503]})
    async def health() -> Response:
        failure = getattr(state.engine, "failure", None)
        if failure is not None:   # the model worker died: the watchdog is about to stop the server
            raise ApiError(503, f"unhealthy: {failure}")
        return Response(status_code=200)

    @app.get("/health_generate", responses=ok_json)
    async def health_generate() -> Response:
        return await _health_generate(state)

    @app.post("/abort_request", openapi_extra=json_body(AbortRequest), responses=ok_json)
    async def abort_request(request: Request) -> Response:
        body = await read_json(request)
        if body.get("abort_all") is True:
            for rid in list(state.active):
                state.abort_request(rid)
            return json_response({"success": True})
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise ApiError(400, "rid must be a non-empty string")
        return json_response({"success": True, "found": state.abort_request(rid)})

    @app.get("/metrics", response_class=Response, responses={200: {"description": "Prometheus metrics",
                                          "content": {METRICS_CONTENT_TYPE: {"schema": {"type": "string"}}}},
                                    401: responses()[401]})
    async def metrics() -> Response:
        try:
            info = await asyncio.to_thread(state.engine.get_server_info)
        except Exception:   # metrics must answer even when the engine does not
            info = None
        return Response(state.metrics.render(info, state.in_flight), media_type=METRICS_CONTENT_TYPE)


# --- app --------------------------------------------------------------------------------------
def add_error_handlers(app: FastAPI, what: str = "server") -> None:
    """Every error in the OpenAI shape: ours, FastAPI's validation (400, not 422), routing (404 /
    405), client disconnects, and anything unexpected (500, logged, no traceback sent). Used by
    the server and by the router (`what` names it in a 500's message)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        endpoint = GENERATE_ENDPOINTS.get(request.url.path)
        state = getattr(request.app.state, "plait", None)   # the router keeps no such state
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
            logger.info("running: %d, queued: %d, http in flight: %d, KV usage: %.1f%%, gen throughput: "
                        "%.1f tok/s, cache hit rate: %.1f%%", info.get("num_running", 0),
                        info.get("num_waiting", 0), state.in_flight, 100 * kv_usage(info), rate,
                        100 * cache_hit_rate(info))


def create_app(engine: Any, api_key: str | None = None, served_model_name: str | None = None,
               max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS, ready_message: str | None = None,
               log_interval: float = LOG_INTERVAL_S, request_timeout: float | None = None,
               log_requests: bool = False) -> FastAPI:
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
    state = ServerState(engine, served_model_name or str(engine.args.model), max_queued_requests,
                        request_timeout, log_requests)

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
    app = FastAPI(title="plait", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
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

    app.openapi = openapi   # type: ignore[method-assign]
    return app


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
    return sock   # not inheritable: the engine's spawned scheduler process must not hold the port


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
    deadline = time.monotonic() + 2.0   # let their handlers send the error
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
                self._captured_signals.clear()   # handled: we drained and exit on our own

    return DrainingServer(config)


def run_server(args: ServerArgs, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
               max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS, served_model_name: str | None = None,
               sock: socket.socket | None = None, request_timeout: float | None = None,
               log_requests: bool = False, drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
    """Load the engine and serve until SIGINT / SIGTERM (drained, see `drain`); the engine is shut
    down on the way out. Raises SystemExit(1) if the engine's processes died."""
    import uvicorn

    from ..engine import Engine
    sock = sock or bind_socket(host, port)
    engine = Engine(**dataclasses.asdict(args))
    died = threading.Event()
    try:
        shown = f"[{host}]" if ":" in host else host
        app = create_app(engine, api_key, served_model_name, max_queued_requests,
                         ready_message=f"plait: ready, serving {args.model} at http://{shown}:{port}",
                         request_timeout=request_timeout, log_requests=log_requests)
        config = uvicorn.Config(app, log_level=args.log_level.lower(), access_log=False,
                                timeout_graceful_shutdown=3)
        server = _draining_server(config, app.state.plait, drain_timeout)
        threading.Thread(target=_watch_engine, args=(engine, server, died), name="plait-watchdog",
                         daemon=True).start()
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
