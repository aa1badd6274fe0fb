"""Running one chat request for an API that is translated onto the chat-completions path (the
Messages API, the Responses API): the engine call, and an SSE stream whose events the API's own
shaper writes from each cumulative result."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable, Iterator

from fastapi import Request

from .http_common import ApiError
from .openai_request import OpenAIRequest, engine_prompts
from .openai_stream import StreamShaper, open_engine_stream
from .server_state import EventStream, ServerState
from .tool_calls import new_call_id

logger = logging.getLogger("plait.http")


async def complete(state: ServerState, request: Request, req: OpenAIRequest, endpoint: str) -> dict[str, Any]:
    """The finished engine result of a one-choice chat request."""
    rids = [f"{req.rid}-0"]
    with state.admit(rids, {req.rid: rids}) as hold:
        results = await state.generate(
            request, hold, endpoint, **engine_prompts(req), sampling_params=req.params, rid=rids
        )
    return results[0]


async def stream(
    state: ServerState,
    request: Request,
    req: OpenAIRequest,
    endpoint: str,
    start: list[str],
    update: Callable[[dict[str, Any]], list[str]],
    error: Callable[[ApiError], str],
) -> EventStream:
    """An SSE response for a one-choice chat request: the `start` events, then `update(result)`'s
    events for each cumulative result, or `error(e)` if the request fails midway."""
    rids = [f"{req.rid}-0"]
    hold, merged, first = await open_engine_stream(state, request, req, rids)

    async def events() -> AsyncIterator[str]:
        for e in start:
            yield e
        try:
            if first is not None:
                for e in update(first[1]):
                    yield e
            while True:
                try:
                    _, result = await state.next_result(hold, merged)
                except StopAsyncIteration:
                    break
                for e in update(result):
                    yield e
                if result["meta_info"].get("finish_reason") is not None:
                    hold.finish(rids[0])
                    state.metrics.observe_result(result, hold.start)
            state.metrics.count_request(endpoint, 200)
        except ApiError as e:
            hold.close()
            yield error(e)
        except Exception:
            logger.exception("stream %s failed", req.rid)
            hold.close()
            yield error(ApiError(500, "internal error while streaming"))
        finally:
            await merged.aclose()

    return EventStream(events(), hold)


def stream_parts(shaper: StreamShaper, result: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """What one cumulative result of choice 0 adds, as the chat stream says it: ("text", delta),
    ("call", (call id, name)) when a tool call starts, ("arguments", delta) of the latest call,
    ("finish", the chat finish reason)."""
    for chunk in shaper.update(0, result):
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        if delta.get("content"):
            yield "text", delta["content"]
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id") or fn.get("name"):  # a call's id and name come once, first
                yield "call", (call.get("id") or new_call_id(), fn["name"])
            if fn.get("arguments"):
                yield "arguments", fn["arguments"]
        if choice.get("finish_reason"):
            yield "finish", choice["finish_reason"]
