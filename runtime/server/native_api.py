"""The native SGLang-compatible API (`docs/protocol.md`): `/generate` (batched, n, streaming),
`/abort_request`, model and server info, `/flush_cache`, health.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from starlette.responses import Response

from ..sampling_params import MAX_INT, MAX_N
from .api_schema import (
    MAX_NATIVE_TOP_LOGPROBS,
    AbortRequest,
    GenerateRequest,
    GenerateResult,
    json_body,
    ref,
    responses,
)
from .http_common import RETRY_AFTER_S, SSE_DONE, ApiError, abort_error, is_abort, is_int, json_response, read_json, sse
from .metrics import METRICS_CONTENT_TYPE, StreamTimer
from .server_state import MAX_SEQS_PER_REQUEST, EventStream, Hold, ServerState

logger = logging.getLogger("plait.http")


HEALTH_GENERATE_TIMEOUT_S = 30.0
FLUSH_WAIT_S = 5.0  # /flush_cache waits this long for running requests to end


# --- native API -------------------------------------------------------------------------------
@dataclasses.dataclass
class NativeRequest:
    """A parsed `POST /generate` body."""

    kwargs: dict[str, Any]  # for engine.async_generate, without rid/stream
    item_rids: list[str]  # one per prompt
    n_per_item: list[int]
    stream: bool
    batch: bool  # the answer is a list


def _type_error(field: str, expected: str, value: Any) -> ApiError:
    return ApiError(400, f"{field} must be {expected}, got {type(value).__name__}")


def _opt(body: dict[str, Any], field: str, default: Any, check: Callable[[Any], bool], expected: str) -> Any:
    value = body.get(field)
    if value is None:
        return default
    if not check(value):
        raise _type_error(field, expected, value)
    return value


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
        raise ApiError(
            400, f"top_logprobs_num must be in [0, {MAX_NATIVE_TOP_LOGPROBS}], got {kwargs['top_logprobs_num']}"
        )
    if not -1 <= kwargs["logprob_start_len"] <= MAX_INT:
        raise ApiError(400, f"logprob_start_len must be >= -1, got {kwargs['logprob_start_len']}")
    kwargs["return_text_in_logprobs"] = _opt(
        body, "return_text_in_logprobs", False, lambda v: isinstance(v, bool), "a bool"
    )
    stream = _opt(body, "stream", False, lambda v: isinstance(v, bool), "a bool")
    n_per_item = [_n_of(p) for p in sp] if isinstance(sp, list) else [_n_of(sp)] * num
    if sum(n_per_item) > MAX_SEQS_PER_REQUEST or max(n_per_item, default=1) > MAX_N:
        raise ApiError(
            400, f"a request may ask for at most {MAX_SEQS_PER_REQUEST} sequences (prompts x n) and n <= {MAX_N}"
        )
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


async def _native_events(
    state: ServerState, hold: Hold, rid: str, first: dict[str, Any], it: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[str]:
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
    except ApiError as e:  # past --request-timeout
        hold.close()  # abort before the client hears of it
        yield sse(e.body())
    except Exception:
        logger.exception("stream %s failed", rid)
        hold.close()
        yield sse(ApiError(500, "internal error while streaming").body())
    yield SSE_DONE


def _model_info(state: ServerState) -> dict[str, Any]:
    return {
        "model_path": state.model_path,
        "tokenizer_path": state.model_path,
        "is_generation": True,
        "served_model_name": state.served_model_name,
        "context_length": state.context_len,
    }


async def _flush(state: ServerState) -> Response:
    deadline = time.monotonic() + FLUSH_WAIT_S
    while True:
        if await asyncio.to_thread(state.engine.flush_cache):
            return json_response({"success": True, "message": "cache flushed"})
        if time.monotonic() > deadline:
            raise ApiError(
                503,
                "the cache was not flushed: requests are still running; retry when idle",
                code="cache_busy",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        await asyncio.sleep(0.05)


async def _health_generate(state: ServerState) -> Response:
    rid = f"health-{uuid.uuid4().hex}"
    try:
        out = await asyncio.wait_for(
            state.engine.async_generate(
                prompt="Hello", sampling_params={"max_new_tokens": 1, "temperature": 0}, rid=rid, strict=False
            ),
            HEALTH_GENERATE_TIMEOUT_S,
        )
    except Exception as e:  # timeout, shutdown: unhealthy, whatever the cause
        state.engine.abort(rid)
        raise ApiError(503, f"the engine could not generate: {type(e).__name__}: {e}") from None
    if is_abort(out):
        raise ApiError(503, f"the engine could not generate: {out['meta_info']['finish_reason']}")
    return json_response({"status": "ok"})


def add_native_routes(app: FastAPI, state: ServerState) -> None:
    """The SGLang-compatible routes of protocol.md."""

    ok_json = responses({"type": "object"})

    @app.post(
        "/generate",
        openapi_extra=json_body(GenerateRequest),
        responses=responses(
            {"anyOf": [ref(GenerateResult), {"type": "array", "items": ref(GenerateResult)}]}, stream=True
        ),
    )
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
    async def flush_cache_get() -> Response:  # SGLang accepts both methods
        return await _flush(state)

    @app.post("/concate_and_append_request", responses=ok_json)
    async def concate_and_append_request() -> Response:
        # The client has already joined the text; answering (not 404) keeps it from hanging.
        return json_response({"success": True})

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "healthy (empty body)"}, 503: responses()[503]},
    )
    async def health() -> Response:
        failure = getattr(state.engine, "failure", None)
        if failure is not None:  # the model worker died: the watchdog is about to stop the server
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

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus metrics",
                "content": {METRICS_CONTENT_TYPE: {"schema": {"type": "string"}}},
            },
            401: responses()[401],
        },
    )
    async def metrics() -> Response:
        try:
            info = await asyncio.to_thread(state.engine.get_server_info)
        except Exception:  # metrics must answer even when the engine does not
            info = None
        return Response(state.metrics.render(info, state.in_flight), media_type=METRICS_CONTENT_TYPE)
