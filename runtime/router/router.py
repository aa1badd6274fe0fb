"""Data parallelism: an HTTP router in front of several plait servers (replicas). `plait serve
--dp-size N`, which starts N replica servers on loopback and this router in front, is in
`replicas.py`.

The router forwards generate requests (`/generate`, `/v1/completions`, `/v1/chat/completions`,
streaming passed through as it comes) to the replica a routing policy picks (`policy.py`:
cache-aware by default), and the rest (`/flush_cache`, `/get_server_info`, `/metrics`, ...) to all
replicas or to any one. A replica that stops answering (connection errors, a 5xx with a failed
health probe, failed background health checks) leaves the rotation and its request is retried on
another one (a stream only while nothing of it was sent); it comes back once healthy again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.responses import Response, StreamingResponse

from ..server.http_common import (
    MAX_BODY_BYTES,
    SSE_DONE,
    ApiError,
    ClientGone,
    sse,
)
from .policy import RoutingPolicy, ids_to_text

logger = logging.getLogger("plait.router")

GENERATE_PATHS = (
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/embeddings",
    "/v1/responses",
)
# Responses live in the memory of the replica that made them: the router remembers which one, so
# `previous_response_id` and GET /v1/responses/{id} reach it (each replica keeps its last 1024).
RESPONSE_OWNERS_PER_REPLICA = 1024
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[0-9a-f]+)"')
HEALTH_INTERVAL_S = 5.0
HEALTH_TIMEOUT_S = 5.0
HEALTH_FAILURES_TO_DOWN = 2  # a timeout may be a busy machine; a refused connection is final at once
CONNECT_TIMEOUT_S = 5.0
# Response headers not passed through: hop-by-hop, or recomputed by our server.
_DROP_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "date",
    "server",
    "content-encoding",
}


@dataclasses.dataclass
class Replica:
    """One replica server as the router sees it."""

    url: str
    healthy: bool = True
    in_flight: int = 0
    routed: int = 0  # requests sent to it (retries included)
    failed_checks: int = 0  # consecutive failed health checks
    last_error: str | None = None
    pid: int | None = None  # when the router started it (--dp-size)

    def describe(self) -> dict[str, Any]:
        """The replica's entry in the router's /get_server_info."""
        out = {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "routed": self.routed,
            "last_error": self.last_error,
        }
        if self.pid is not None:
            out["pid"] = self.pid
        return out


class _Retry(Exception):
    """This attempt failed in a way another replica may not: try the next one."""

    def __init__(self, response: Response | None = None):
        self.response = response  # the replica's own error answer, sent if no replica is left


# --- routing text -----------------------------------------------------------------------------
def _first_prompt(value: Any) -> str:
    """The routing text of a prompt field: a string, token ids, or (a batch) its first item."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return ids_to_text(value)
        return _first_prompt(value[0])
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def routing_text(path: str, body: Any) -> str:
    """The text a request is routed by: the prompt (or its first item for a batch), token ids as
    characters, or chat messages' contents concatenated with their roles. '' if there is none."""
    if not isinstance(body, dict):
        return ""
    if path in ("/v1/chat/completions", "/v1/messages"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        system = _content_text(body.get("system"))  # the Messages API's system prompt comes first
        return (f"system: {system}\n" if system else "") + "".join(
            f"{m.get('role')}: {_content_text(m.get('content'))}\n" for m in messages if isinstance(m, dict)
        )
    if path == "/v1/responses":  # instructions first, then the input (text or items)
        items = body.get("input")
        if isinstance(items, list):
            items = "".join(
                f"{i.get('role', i.get('type'))}: {_content_text(i.get('content', i.get('output')))}\n"
                for i in items
                if isinstance(i, dict)
            )
        return f"{_content_text(body.get('instructions'))}\n{items if isinstance(items, str) else ''}"
    if path == "/v1/completions":
        return _first_prompt(body.get("prompt"))
    if path == "/v1/embeddings":
        return _first_prompt(body.get("input"))
    if body.get("text") is not None:
        return _first_prompt(body.get("text"))
    return _first_prompt(body.get("input_ids"))


async def read_body(request: Request) -> bytes:
    """The raw request body; 413 past MAX_BODY_BYTES (chunked bodies included)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    return bytes(body)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _race_disconnect(request: Request, aw: Any) -> Any:
    """Await `aw`; cancel it and raise ClientGone if the client disconnects first (the body has
    been read, so the next ASGI message is the disconnect). Cancelling closes the connection to
    the replica, which then aborts the request."""
    task = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()


# --- metrics ----------------------------------------------------------------------------------
class RouterMetrics:
    """The router's own Prometheus metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "plait_router_requests",
            "Requests the router sent to a replica, by replica and answer status (0: no answer)",
            ["replica", "status"],
            registry=self.registry,
        )
        self.retries = Counter("plait_router_retries", "Requests retried on another replica", registry=self.registry)
        self.healthy = Gauge(
            "plait_router_replica_healthy", "1 while a replica is in rotation", ["replica"], registry=self.registry
        )
        self.in_flight = Gauge(
            "plait_router_replica_in_flight", "Requests in flight per replica", ["replica"], registry=self.registry
        )

    def render(self, replicas: Sequence[Replica]) -> bytes:
        for r in replicas:
            self.healthy.labels(replica=r.url).set(1 if r.healthy else 0)
            self.in_flight.labels(replica=r.url).set(r.in_flight)
        return generate_latest(self.registry)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


def label_metrics(text: str, replica: str, seen_meta: set[str]) -> list[str]:
    """A replica's Prometheus exposition with `replica="URL"` added to every sample; HELP / TYPE
    lines only the first time a metric is met (they may appear once per exposition)."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            if line not in seen_meta:
                seen_meta.add(line)
                out.append(line)
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, rest = m.groups()
        inner = labels[1:-1] if labels else ""
        out.append(f'{name}{{replica="{replica}"{"," + inner if inner else ""}}}{rest}')
    return out


# --- the router -------------------------------------------------------------------------------
class Router:
    """Routing state shared by the route handlers: replicas, policy, HTTP client, health loop."""

    def __init__(
        self,
        urls: Sequence[str],
        policy: RoutingPolicy,
        worker_api_key: str | None = None,
        health_interval: float = HEALTH_INTERVAL_S,
        health_timeout: float = HEALTH_TIMEOUT_S,
        pids: Sequence[int] | None = None,
    ):
        if not urls:
            raise ValueError("the router needs at least one worker URL")
        self.replicas: dict[str, Replica] = {}
        for i, url in enumerate(urls):
            url = url.rstrip("/")
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL {url!r} must start with http:// or https://")
            if url in self.replicas:
                raise ValueError(f"worker URL {url!r} is given twice")
            self.replicas[url] = Replica(url, pid=pids[i] if pids else None)
        self.policy = policy
        self.worker_api_key = worker_api_key
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.metrics = RouterMetrics()
        self.client: httpx.AsyncClient | None = None
        self.response_owners: OrderedDict[str, str] = OrderedDict()  # response id -> replica url

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the HTTP client (inside the server's event loop)."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S), limits=limits)

    async def stop(self) -> None:
        """Close the HTTP client."""
        if self.client is not None:
            await self.client.aclose()

    async def health_loop(self) -> None:
        """Check every replica every `health_interval` seconds, the first time at once."""
        while True:
            await asyncio.gather(*(self.check(r) for r in self.replicas.values()))
            await asyncio.sleep(self.health_interval)

    # --- health -----------------------------------------------------------------------------
    async def probe(self, replica: Replica) -> str | None:
        """GET /health on the replica: None if it answers 200, else why not."""
        try:
            resp = await self.client.get(replica.url + "/health", timeout=self.health_timeout)
        except httpx.ConnectError as e:
            return f"connection refused: {e}" if str(e) else "connection refused"
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"
        return None if resp.status_code == 200 else f"/health answered {resp.status_code}"

    async def check(self, replica: Replica) -> bool:
        """One health check; takes the replica out of rotation or puts it back."""
        error = await self.probe(replica)
        if error is None:
            replica.failed_checks = 0
            if not replica.healthy:
                logger.info("replica %s is healthy again", replica.url)
                replica.healthy, replica.last_error = True, None
            return True
        replica.failed_checks += 1
        if replica.healthy and (
            error.startswith("connection refused") or replica.failed_checks >= HEALTH_FAILURES_TO_DOWN
        ):
            self.mark_down(replica, error)
        return False

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Take a replica out of rotation; what the policy knew of its cache is dropped (a
        replica that comes back has most likely restarted with an empty cache)."""
        replica.last_error = reason
        if replica.healthy:
            logger.warning("replica %s taken out of rotation: %s", replica.url, reason)
            replica.healthy = False
            self.policy.forget(replica.url)

    def healthy(self) -> list[Replica]:
        """Replicas in rotation."""
        return [r for r in self.replicas.values() if r.healthy]

    def no_replica_error(self) -> ApiError:
        """503 when no replica is in rotation."""
        down = "; ".join(f"{r.url}: {r.last_error or 'unhealthy'}" for r in self.replicas.values())
        return ApiError(
            503,
            f"no healthy replica to serve the request ({down})",
            code="no_healthy_replica",
            headers={"Retry-After": "1"},
        )

    # --- forwarding -------------------------------------------------------------------------
    def forward_headers(self, request: Request) -> dict[str, str]:
        """Headers sent to a replica: the worker key when given, else the client's own
        Authorization (for replicas that share the router's key)."""
        headers = {k: request.headers[k] for k in ("content-type", "accept") if k in request.headers}
        if self.worker_api_key:
            headers["authorization"] = f"Bearer {self.worker_api_key}"
        elif "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        return headers

    async def route(self, request: Request, path: str) -> Response:
        """Forward a generate request to the replica the policy picks, retrying elsewhere while
        replicas fail; 503 when none is left."""
        raw = await read_body(request)
        try:
            body = json.loads(raw) if raw.strip() else None
        except (ValueError, UnicodeDecodeError):
            body = None  # the replica answers the 400
        text = routing_text(path, body)
        stream = isinstance(body, dict) and body.get("stream") is True
        owner = self.response_owner(body.get("previous_response_id")) if isinstance(body, dict) else None
        headers = self.forward_headers(request)
        tried: set[str] = set()
        last_error: Response | None = None
        while True:
            loads = {r.url: r.in_flight for r in self.healthy() if r.url not in tried}
            if owner in loads:  # the replica that holds the previous response
                loads = {owner: loads[owner]}
            if not loads:
                if last_error is not None:
                    return last_error
                raise self.no_replica_error()
            if tried:
                self.metrics.retries.inc()
            replica = self.replicas[self.policy.choose(text, loads)]
            tried.add(replica.url)
            try:
                return await self._attempt(request, replica, path, raw, headers, stream)
            except _Retry as e:
                last_error = e.response or last_error

    async def _attempt(
        self, request: Request, replica: Replica, path: str, raw: bytes, headers: dict[str, str], stream: bool
    ) -> Response:
        replica.in_flight += 1
        replica.routed += 1
        handed_over = False  # a streaming response then owns the in-flight count
        resp: httpx.Response | None = None
        try:
            req = self.client.build_request("POST", replica.url + path, content=raw, headers=headers)
            try:
                resp = await _race_disconnect(request, self.client.send(req, stream=True))
            except httpx.TransportError as e:
                self.metrics.requests.labels(replica=replica.url, status="0").inc()
                self.mark_down(replica, f"{type(e).__name__}: {e}")
                raise _Retry() from None
            self.metrics.requests.labels(replica=replica.url, status=str(resp.status_code)).inc()
            if resp.status_code != 200 or not stream:
                try:
                    content = await _race_disconnect(request, resp.aread())
                except httpx.TransportError as e:
                    self.mark_down(replica, f"{type(e).__name__}: {e}")
                    raise _Retry() from None
                answer = plain_response(resp, content)
                if path == "/v1/responses" and resp.status_code == 200:
                    self.remember_response(content, replica)
                if resp.status_code >= 500:
                    await self._on_server_error(replica, resp.status_code, answer)
                return answer
            # Stream: the first chunk is read before answering, so a replica that dies now is
            # still retried elsewhere (the client has seen nothing yet).
            chunks = resp.aiter_raw()
            try:
                first = await _race_disconnect(request, chunks.__anext__())
            except StopAsyncIteration:
                first = b""
            except httpx.TransportError as e:
                self.mark_down(replica, f"{type(e).__name__}: {e}")
                raise _Retry() from None
            if path == "/v1/responses":  # the first event, response.created, carries the id
                self.remember_response(first, replica)
            handed_over = True
            return RelayStream(self._relay(replica, first, chunks), resp, replica, headers=_pass_headers(resp))
        finally:
            if not handed_over:
                replica.in_flight -= 1
                if resp is not None:
                    await resp.aclose()

    async def _on_server_error(self, replica: Replica, status: int, answer: Response) -> None:
        """A 5xx: a 503 (overloaded, shutting down) is tried elsewhere; another 5xx too if the
        replica fails a health probe (it is dying), else it is the answer."""
        if status == 503:
            raise _Retry(answer)
        error = await self.probe(replica)
        if error is not None:
            self.mark_down(replica, f"answered {status}, then {error}")
            raise _Retry(answer)

    async def _relay(self, replica: Replica, first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The stream's bytes as they come; a replica failing mid-stream ends it with an error event."""
        if first:
            yield first
        try:
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as e:
            self.mark_down(replica, f"{type(e).__name__}: {e}")
            yield sse(
                ApiError(502, f"replica {replica.url} failed mid-stream", "server_error", "replica_failed").body()
            ).encode()
            yield SSE_DONE.encode()

    def remember_response(self, content: bytes, replica: Replica) -> None:
        """Note the replica that made the response whose id `content` starts with."""
        m = _RESPONSE_ID.search(content[:4096])
        if m is None:
            return
        rid = m.group(1).decode()
        self.response_owners[rid] = replica.url
        self.response_owners.move_to_end(rid)
        while len(self.response_owners) > RESPONSE_OWNERS_PER_REPLICA * len(self.replicas):
            self.response_owners.popitem(last=False)

    def response_owner(self, response_id: Any) -> str | None:
        """The replica that made a response, if the router saw it (and still remembers)."""
        return self.response_owners.get(response_id) if isinstance(response_id, str) else None

    async def get_response(self, request: Request, response_id: str) -> Response:
        """GET /v1/responses/{id} from the replica that made it; for one the router did not see
        (made before a restart), every healthy replica is asked and the first that has it answers."""
        owner = self.response_owners.get(response_id)
        path = f"/v1/responses/{response_id}"
        if owner is not None and self.replicas[owner].healthy:
            headers = self.forward_headers(request)
            resp = await self.client.request("GET", owner + path, headers=headers, timeout=60)
            return plain_response(resp, resp.content)
        answers = await self.all_replicas(request, "GET", path)
        found = [a for _, a in answers if isinstance(a, httpx.Response) and a.status_code == 200]
        answer = (found or [a for _, a in answers if isinstance(a, httpx.Response)] or [None])[0]
        if answer is None:
            raise self.no_replica_error()
        return plain_response(answer, answer.content)

    async def any_replica(self, request: Request, method: str, path: str) -> Response:
        """Forward a request that any replica can answer to the first healthy one that does."""
        headers = self.forward_headers(request)
        raw = await read_body(request) if method == "POST" else None
        for replica in self.healthy():
            try:
                resp = await self.client.request(method, replica.url + path, content=raw, headers=headers, timeout=60)
            except httpx.TransportError as e:
                self.mark_down(replica, f"{type(e).__name__}: {e}")
                continue
            return plain_response(resp, resp.content)
        raise self.no_replica_error()

    async def all_replicas(self, request: Request, method: str, path: str) -> list[tuple[Replica, Any]]:
        """Send the same request to every healthy replica: (replica, httpx response or exception)."""
        headers = self.forward_headers(request)
        raw = await read_body(request) if method == "POST" else None
        replicas = self.healthy()
        if not replicas:
            raise self.no_replica_error()

        async def one(r: Replica) -> Any:
            try:
                return await self.client.request(method, r.url + path, content=raw, headers=headers, timeout=60)
            except httpx.HTTPError as e:
                if isinstance(e, httpx.TransportError):
                    self.mark_down(r, f"{type(e).__name__}: {e}")
                return e

        return list(zip(replicas, await asyncio.gather(*(one(r) for r in replicas))))

    async def server_info(self, request: Request) -> dict[str, Any]:
        """Per-replica server info (healthy replicas asked), with totals over them."""
        answers = {r.url: a for r, a in await self._gather_healthy(request, "/get_server_info")}
        entries, totals = [], {}
        for r in self.replicas.values():
            entry = r.describe()
            a = answers.get(r.url)
            if isinstance(a, httpx.Response) and a.status_code == 200:
                entry["server_info"] = info = a.json()
                for key in (
                    "num_prompt_tokens",
                    "num_cached_tokens",
                    "num_generated_tokens",
                    "num_running",
                    "num_waiting",
                ):
                    if isinstance(info.get(key), (int, float)):
                        totals[key] = totals.get(key, 0) + info[key]
            elif a is not None:
                entry["error"] = (
                    f"HTTP {a.status_code}" if isinstance(a, httpx.Response) else f"{type(a).__name__}: {a}"
                )
            entries.append(entry)
        prompt = totals.get("num_prompt_tokens", 0)
        return {
            "router": True,
            "policy": self.policy.name,
            "dp_size": len(self.replicas),
            "num_healthy_replicas": len(self.healthy()),
            **totals,
            "cache_hit_rate": totals.get("num_cached_tokens", 0) / prompt if prompt else 0.0,
            "replicas": entries,
        }

    async def _gather_healthy(self, request: Request, path: str) -> list[tuple[Replica, Any]]:
        if not self.healthy():
            return []
        return await self.all_replicas(request, "GET", path)


class RelayStream(StreamingResponse):
    """A streamed replica answer passed through; the replica connection and the in-flight count
    are released however it ends (finished, failed, client gone, or never started)."""

    def __init__(
        self, content: AsyncIterator[bytes], upstream: httpx.Response, replica: Replica, headers: dict[str, str]
    ):
        super().__init__(content, headers=headers)
        self.upstream = upstream
        self.replica = replica

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.replica.in_flight -= 1
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
            with contextlib.suppress(Exception):
                await self.upstream.aclose()


def _pass_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_HEADERS}


def plain_response(resp: httpx.Response, content: bytes) -> Response:
    return Response(content, status_code=resp.status_code, headers=_pass_headers(resp))
