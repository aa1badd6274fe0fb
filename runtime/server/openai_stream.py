"""Streaming OpenAI responses: engine streams merged across prompts and n, shaped into chunks
(`StreamShaper`), sent as SSE with usage and errors in OpenAI's form.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from fastapi import Request
from starlette.responses import Response

from .http_common import SSE_DONE, ApiError, is_int, sse
from .metrics import StreamTimer
from .openai_request import GRAMMAR_PARAMS, OpenAIRequest
from .openai_response import (
    chat_logprobs,
    completion_logprobs,
    envelope,
    finish_reason,
    result_logprobs,
    usage,
    visible_tokens,
)
from .reasoning import ReasoningStream
from .server_state import EventStream, Hold, ServerState
from .tool_calls import ToolStream

logger = logging.getLogger("plait.http")


# --- streaming --------------------------------------------------------------------------------
class StreamShaper:
    """Cumulative engine results of each choice -> OpenAI chunks (deltas)."""

    def __init__(self, req: OpenAIRequest, state: ServerState):
        self.req = req
        self.env = envelope(req, state, int(time.time()), True)
        self.text_len: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.prompt_tokens: dict[int, int] = {}  # per prompt
        self.cached_tokens: dict[int, int] = {}  # per prompt (see cached_prompt_tokens)
        self.completion_tokens = 0
        self.tool_streams: dict[int, ToolStream] = {}
        self.reasoning_streams: dict[int, ReasoningStream] = {}

    def _chunk(self, index: int, delta: dict[str, Any] | str, logprobs: Any, reason: str | None) -> dict:
        choice: dict[str, Any] = {"index": index}
        if self.req.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice["logprobs"] = logprobs
        choice["finish_reason"] = reason
        out = {**self.env, "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def update(self, index: int, result: dict[str, Any]) -> list[dict[str, Any]]:
        """Chunks for one new cumulative result of choice `index` (an abort raises its error)."""
        chunks = []
        if self.req.chat and index not in self.text_len:
            chunks.append(self._chunk(index, {"role": "assistant", "content": ""}, None, None))
        reason = finish_reason(result)
        prev_len, prev_tokens = self.text_len.get(index, 0), self.tokens.get(index, 0)
        text = result["text"]
        if self.req.reasoning is not None:  # the reasoning goes out first; the rest sees the content only
            rs = self.reasoning_streams.setdefault(index, ReasoningStream(self.req.reasoning))
            thought, content = rs.update(text, final=reason is not None)
            if thought:
                chunks.append(self._chunk(index, {"reasoning_content": thought}, None, None))
            text = content or ""
        delta = text[prev_len:]
        upto = visible_tokens(result) if reason else result["meta_info"]["completion_tokens"]
        logprobs = None
        if self.req.logprobs is not None:
            entries = result_logprobs(result, prev_tokens, upto)
            if entries:
                logprobs = (
                    chat_logprobs(entries)
                    if self.req.chat
                    else completion_logprobs(entries, prev_len, self.req.logprobs)
                )
        if self.req.chat and self.req.tools is not None:
            ts = self.tool_streams.setdefault(index, ToolStream(self.req.tools))
            if reason:
                deltas, reason = ts.finish(text, reason)
            else:
                deltas = ts.update(text)
            if not deltas and logprobs:
                deltas = [{}]
            for k, d in enumerate(deltas):
                chunks.append(self._chunk(index, d, logprobs if k == 0 else None, None))
        elif delta or logprobs:
            chunks.append(self._chunk(index, {"content": delta} if self.req.chat else delta, logprobs, None))
        self.text_len[index], self.tokens[index] = max(prev_len, len(text)), max(prev_tokens, upto)
        if reason:
            chunks.append(self._chunk(index, {} if self.req.chat else "", None, reason))
            meta = result["meta_info"]
            self.prompt_tokens[index // self.req.n] = meta["prompt_tokens"]
            p = index // self.req.n
            self.cached_tokens[p] = min(self.cached_tokens.get(p, meta["cached_tokens"]), meta["cached_tokens"])
            self.completion_tokens += meta["completion_tokens"]
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        """The final chunk of `stream_options.include_usage`."""
        cached = sum(self.cached_tokens.values())
        return {
            **self.env,
            "choices": [],
            "usage": usage(sum(self.prompt_tokens.values()), self.completion_tokens, cached),
        }


async def merge_streams(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """(index, result) from several streams as they arrive; closing this closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, it: AsyncIterator[dict]) -> None:
        try:
            async for r in it:
                queue.put_nowait((i, r))
        except Exception as e:  # handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, end))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _open_streams(state: ServerState, req: OpenAIRequest, rids: list[str]) -> list[AsyncIterator[dict]]:
    """One engine stream per choice (n copies of each prompt, seeds seed, seed+1, ... as the engine
    does for n)."""
    streams = []
    for idx, rid in enumerate(rids):
        j, i = divmod(idx, req.n)
        params = {**req.params[j], "n": 1}
        if params.get("seed") is not None and is_int(params["seed"]):
            params["seed"] += i
        key = "prompt" if isinstance(req.prompts[j], str) else "input_ids"
        streams.append(
            await state.open_stream(
                rid,
                **{key: req.prompts[j]},
                sampling_params=params,
                return_logprob=req.logprobs is not None,
                top_logprobs_num=req.logprobs or 0,
                return_text_in_logprobs=True,
            )
        )
    return streams


def _constrained(req: OpenAIRequest) -> bool:
    return any(p.get(k) is not None for p in req.params for k in GRAMMAR_PARAMS)


async def open_engine_stream(
    state: ServerState, request: Request, req: OpenAIRequest, rids: list[str]
) -> tuple[Hold, AsyncIterator[tuple[int, dict]], tuple[int, dict] | None]:
    """Admit a streamed request and open one engine stream per choice: (its hold, the merged
    (choice, result) stream, the first result when the request is constrained, else None)."""
    hold = state.admit(rids, {req.rid: rids})  # the response id aborts every choice
    merged = None
    first: tuple[int, dict] | None = None
    try:
        streams = await _open_streams(state, req, rids)
        merged = merge_streams(streams)
        if _constrained(req):
            # a grammar that does not compile ends the request before its first token: wait for
            # the first result, so that is a plain 400 rather than an error event
            try:
                first = await state.watch(request, merged.__anext__(), hold)
            except StopAsyncIteration:
                raise ApiError(500, "the engine ended the stream without a result") from None
            state.check_result(first[1])
    except BaseException:
        if merged is not None:
            await merged.aclose()
        hold.close()
        raise
    return hold, merged, first


async def stream_response(state: ServerState, request: Request, req: OpenAIRequest) -> Response:
    rids = [f"{req.rid}-{k}" for k in range(len(req.prompts) * req.n)]
    hold, merged, first = await open_engine_stream(state, request, req, rids)
    return EventStream(_events(state, req, hold, rids, merged, first), hold)


async def _with_first(
    first: tuple[int, dict] | None, rest: AsyncIterator[tuple[int, dict]]
) -> AsyncIterator[tuple[int, dict]]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


async def _events(
    state: ServerState,
    req: OpenAIRequest,
    hold: Hold,
    rids: list[str],
    merged: AsyncIterator[tuple[int, dict]],
    first: tuple[int, dict] | None,
) -> AsyncIterator[str]:
    shaper = StreamShaper(req, state)
    timers = [StreamTimer(state.metrics, hold.start) for _ in rids]
    items = _with_first(first, merged)
    try:
        while True:
            try:
                idx, result = await state.next_result(hold, items)  # 504 past --request-timeout
            except StopAsyncIteration:
                break
            timers[idx].update(result)
            for chunk in shaper.update(idx, result):
                yield sse(chunk)
            if result["meta_info"].get("finish_reason") is not None:
                hold.finish(rids[idx])
                state.metrics.observe_result(result, hold.start)
        if req.include_usage:
            yield sse(shaper.usage_chunk())
        state.metrics.count_request("chat" if req.chat else "completions", 200)
    except ApiError as e:
        hold.close()  # abort the other choices before the client hears of it
        yield sse(e.body())
    except Exception:
        logger.exception("stream %s failed", req.rid)
        hold.close()
        yield sse(ApiError(500, "internal error while streaming").body())
    finally:
        await items.aclose()
        await merged.aclose()
    yield SSE_DONE
