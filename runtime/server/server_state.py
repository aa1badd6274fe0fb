"""What the API's route handlers share: `ServerState` (the engine, the bound on requests in
flight, limits, metrics, the engine calls with deadline and disconnect watch), the `Hold` of one
admitted request, and `EventStream`, an SSE response that always releases its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from starlette.responses import StreamingResponse

from .http_common import RETRY_AFTER_S, ApiError, ClientGone, abort_error, dumps, is_abort
from .metrics import ServerMetrics

logger = logging.getLogger("plait.http")


MAX_SEQS_PER_REQUEST = 1024  # prompts x n of one request
LOGGED_BODY_CHARS = 2000  # --log-requests: a request body is cut to this length


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
                with contextlib.suppress(Exception):  # e.g. an engine already shut down
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

    def __init__(
        self,
        engine: Any,
        served_model_name: str,
        max_queued_requests: int,
        request_timeout: float | None = None,
        log_requests: bool = False,
    ):
        self.engine = engine
        self.served_model_name = served_model_name
        self.model_path = str(engine.args.model)
        self.max_queued_requests = max_queued_requests
        self.request_timeout = request_timeout
        self.log_requests = log_requests
        self.draining = False  # shutting down: new generate requests get 503
        self.in_flight = 0
        self.active: dict[str, Hold] = {}  # engine rid -> its request
        self.aliases: dict[str, list[str]] = {}  # a client-visible id -> its engine rids (n copies)
        self.user_aborted: set[str] = set()  # rids aborted on purpose: their result is not an error
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
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.served_model_name!r}",
                code="model_not_found",
            )

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
            raise ApiError(
                400, f"a request may ask for at most {MAX_SEQS_PER_REQUEST} sequences (prompts x n), got {len(rids)}"
            )
        if self.in_flight >= self.max_queued_requests:
            raise ApiError(
                503,
                f"the server is at its limit of {self.max_queued_requests} requests in flight; retry later",
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
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
            self.engine.abort(rid)  # may not have reached the server's books; harmless if unknown
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
        return ApiError(
            504,
            f"the request took longer than the server's limit of {self.request_timeout:g} s and was aborted",
            code="request_timeout",
        )

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
        if "max_total_num_tokens" in info:  # held by running requests: neither free nor cached
            info["kv_slots_in_use"] = (
                info["max_total_num_tokens"] - info.get("free_slots", 0) - info.get("cache_size", 0)
            )
        for name in ("scheduler_pid", "detokenizer_pid"):  # for operators (and fault-injection tests)
            pid = getattr(self.engine, name, None)
            if isinstance(pid, int):
                info[name] = pid
        return {
            **info,
            "version": __version__,
            "served_model_name": self.served_model_name,
            "model_path": self.model_path,
            "max_queued_requests": self.max_queued_requests,
            "num_http_in_flight": self.in_flight,
        }


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
