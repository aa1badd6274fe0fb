"""OpenAI-compatible routes over the engine: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Requests are translated into engine calls (sampling params in the native protocol's names) and
results into OpenAI's shapes. finish reasons map `{"type": "stop"}` -> "stop" and
`{"type": "length"}` -> "length"; an abort is an error. Extensions accepted as in SGLang: top_k,
min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, regex, ebnf, json_schema,
no_stop_trim, skip_special_tokens.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from starlette.responses import Response

from .http_server import (SSE_DONE, ApiError, EventStream, Hold, ServerState, abort_error, expand_rids, is_int,
                          json_response, read_json, sse)
from .server_metrics import StreamTimer

logger = logging.getLogger("plait.http")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for the legacy completions API
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# OpenAI-side name -> sampling parameter, for the extensions passed through.
EXTRA_PARAMS = {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                "min_tokens": "min_new_tokens", "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
                "regex": "regex", "ebnf": "ebnf", "json_schema": "json_schema", "no_stop_trim": "no_stop_trim",
                "skip_special_tokens": "skip_special_tokens",
                "spaces_between_special_tokens": "spaces_between_special_tokens"}


@dataclasses.dataclass
class OpenAIRequest:
    """A parsed completions or chat request."""
    chat: bool
    prompts: list[str | list[int]]          # text or token ids, one per prompt
    params: list[dict[str, Any]]            # sampling params per prompt (n included)
    n: int
    logprobs: int | None                    # top-k count when logprobs are asked for, else None
    stream: bool
    include_usage: bool
    rid: str                                # also the response id

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


# --- parsing ----------------------------------------------------------------------------------
def _field(body: dict[str, Any], name: str, check, expected: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise ApiError(400, f"{name} must be {expected}, got {type(value).__name__}")
    return value


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _reject_unsupported(body: dict[str, Any]) -> None:
    if body.get("echo"):
        raise ApiError(400, "echo is not supported")
    if body.get("suffix"):
        raise ApiError(400, "suffix is not supported")
    if body.get("logit_bias"):
        raise ApiError(400, "logit_bias is not supported")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1 and best_of != body.get("n", 1):
        raise ApiError(400, "best_of is not supported")
    if (body.get("tools") and body.get("tool_choice") != "none") or body.get("functions"):
        raise ApiError(400, "tools / function calling are not supported")


def _response_format(body: dict[str, Any]) -> str | None:
    """response_format -> a json_schema string for the grammar backend (None: free text)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object")
        return json.dumps(schema)
    raise ApiError(400, "response_format.type must be 'text', 'json_object' or 'json_schema'")


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        value = _field(body, name, is_int, "an int")
        if value is not None:
            if value < 0:
                raise ApiError(400, f"{name} must be >= 0, got {value}")
            return value
    return None


def _sampling(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The sampling params shared by all prompts (max_new_tokens is set per prompt later)."""
    sp = {"temperature": body.get("temperature"), "top_p": body.get("top_p"), "n": body.get("n"),
          "stop": body.get("stop"), "seed": body.get("seed"),
          "frequency_penalty": body.get("frequency_penalty"), "presence_penalty": body.get("presence_penalty")}
    for name, target in EXTRA_PARAMS.items():
        if body.get(name) is not None:
            sp[target] = body[name]
    schema = _response_format(body)
    if schema is not None:
        sp["json_schema"] = schema
    return {k: v for k, v in sp.items() if v is not None}


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if chat:
        want = _field(body, "logprobs", _is_bool, "a bool", False)
        k = _field(body, "top_logprobs", is_int, "an int", 0)
        if k and not want:
            raise ApiError(400, "top_logprobs needs logprobs: true")
    else:
        k = _field(body, "logprobs", is_int, "an int")
        want = k is not None
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{'top_logprobs' if chat else 'logprobs'} must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
    return (k or 0) if want else None


def _completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                   "lists of token ids (non-empty)")


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts")


def render_chat(tokenizer: Any, messages: Any) -> list[int]:
    """Messages -> prompt token ids through the tokenizer's chat template, with the generation
    prompt appended. The template supplies the special tokens, so none are added again."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    conv = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        conv.append({"role": "system" if role == "developer" else role, "content": _content_text(m.get("content"), i)})
    try:
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    except Exception as e:   # jinja errors (e.g. roles out of order) are the caller's to fix
        raise ApiError(400, f"messages could not be rendered with the chat template: {e}") from None
    return tokenizer(text, add_special_tokens=False).input_ids


def parse_openai(state: ServerState, body: dict[str, Any], chat: bool) -> OpenAIRequest:
    """Validate and translate a completions (chat=False) or chat completions body."""
    state.check_model(body)
    _reject_unsupported(body)
    if chat:
        prompts: list[str | list[int]] = [render_chat(state.engine.tokenizer, body.get("messages"))]
    else:
        prompts = _completion_prompts(body)
    base = _sampling(body, chat)
    max_tokens = _max_tokens(body, chat)
    params = [{**base, "max_new_tokens": _default_max(state, p, max_tokens, chat)} for p in prompts]
    n = _field(body, "n", is_int, "an int", 1)
    if n < 1:
        raise ApiError(400, f"n must be >= 1, got {n}")
    stream = _field(body, "stream", _is_bool, "a bool", False)
    opts = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = bool(stream and opts.get("include_usage"))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    return OpenAIRequest(chat, prompts, params, n, _logprobs(body, chat), stream, include_usage, rid)


def _default_max(state: ServerState, prompt: str | list[int], max_tokens: int | None, chat: bool) -> int:
    if max_tokens is not None:
        return max_tokens
    if not chat or not state.context_len:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    # chat: up to the end of the context, as OpenAI does (an over-long prompt fails in the engine)
    return max(state.context_len - len(prompt), 1)


# --- shaping results --------------------------------------------------------------------------
def finish_reason(result: dict[str, Any]) -> str | None:
    """Our finish reason -> OpenAI's; an abort raises its error."""
    reason = result["meta_info"].get("finish_reason")
    if reason is None:
        return None
    if reason.get("type") == "abort":
        raise abort_error(reason)
    return "length" if reason.get("type") == "length" else "stop"


def visible_tokens(result: dict[str, Any]) -> int:
    """Generated tokens shown as text: all but a final EOS / stop-token id."""
    ids = result.get("output_ids") or []
    reason = result["meta_info"].get("finish_reason") or {}
    matched = reason.get("matched")
    hidden = is_int(matched) and bool(ids) and ids[-1] == matched
    return len(ids) - int(hidden)


def _token_logprobs(result: dict[str, Any], start: int, end: int) -> list[tuple[str, float, list]]:
    """(text, logprob, [(text, logprob), ...]) for output positions [start, end)."""
    meta = result["meta_info"]
    lps = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    out = []
    for k in range(start, min(end, len(lps))):
        lp, _, text = lps[k]
        top = tops[k] if k < len(tops) and tops[k] else []
        out.append((text or "", lp, [(t or "", l) for l, _, t in top]))
    return out


def chat_logprobs(entries: list[tuple[str, float, list]]) -> dict[str, Any]:
    """OpenAI chat `logprobs` object."""
    def one(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**one(t, lp), "top_logprobs": [one(tt, tl) for tt, tl in top]} for t, lp, top in entries]}


def completion_logprobs(entries: list[tuple[str, float, list]], offset: int, k: int) -> dict[str, Any]:
    """OpenAI completions `logprobs` object; `offset` is where the first token starts in the text."""
    offsets = []
    for text, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{tt: tl for tt, tl in top} for _, _, top in entries] if k else None,
            "text_offset": offsets}


def _choice(req: OpenAIRequest, index: int, result: dict[str, Any]) -> dict[str, Any]:
    reason = finish_reason(result)
    entries = _token_logprobs(result, 0, visible_tokens(result)) if req.logprobs is not None else None
    if req.chat:
        return {"index": index, "message": {"role": "assistant", "content": result["text"]},
                "logprobs": chat_logprobs(entries) if entries is not None else None, "finish_reason": reason}
    return {"index": index, "text": result["text"], "finish_reason": reason,
            "logprobs": completion_logprobs(entries, 0, req.logprobs) if entries is not None else None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI `usage`."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _envelope(req: OpenAIRequest, state: ServerState, created: int, chunk: bool) -> dict[str, Any]:
    obj = req.object + (".chunk" if chunk and req.chat else "")
    return {"id": req.rid, "object": obj, "created": created, "model": state.served_model_name}


# --- non-streaming ----------------------------------------------------------------------------
def _engine_prompts(req: OpenAIRequest) -> dict[str, Any]:
    key = "prompt" if isinstance(req.prompts[0], str) else "input_ids"
    return {key: list(req.prompts)}


async def _complete(state: ServerState, request: Request, req: OpenAIRequest) -> Response:
    item_rids = [f"{req.rid}-{j}" for j in range(len(req.prompts))]
    endpoint = "chat" if req.chat else "completions"
    rids = expand_rids(item_rids, [req.n] * len(item_rids))
    with state.admit(rids, {req.rid: rids}) as hold:
        results = await state.generate(
            request, hold, endpoint, **_engine_prompts(req), sampling_params=req.params, rid=item_rids,
            return_logprob=req.logprobs is not None, top_logprobs_num=req.logprobs or 0,
            return_text_in_logprobs=True)
    choices = [_choice(req, i, r) for i, r in enumerate(results)]
    prompt_tokens = sum(results[j * req.n]["meta_info"]["prompt_tokens"] for j in range(len(req.prompts)))
    completion_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    return json_response({**_envelope(req, state, int(time.time()), False), "choices": choices,
                          "usage": usage(prompt_tokens, completion_tokens)})


# --- streaming --------------------------------------------------------------------------------
class StreamShaper:
    """Cumulative engine results of each choice -> OpenAI chunks (deltas)."""

    def __init__(self, req: OpenAIRequest, state: ServerState):
        self.req = req
        self.env = _envelope(req, state, int(time.time()), True)
        self.text_len: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.prompt_tokens: dict[int, int] = {}     # per prompt
        self.completion_tokens = 0

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
        delta = text[prev_len:]
        upto = visible_tokens(result) if reason else result["meta_info"]["completion_tokens"]
        logprobs = None
        if self.req.logprobs is not None:
            entries = _token_logprobs(result, prev_tokens, upto)
            if entries:
                logprobs = chat_logprobs(entries) if self.req.chat else \
                    completion_logprobs(entries, prev_len, self.req.logprobs)
        if delta or logprobs:
            chunks.append(self._chunk(index, {"content": delta} if self.req.chat else delta, logprobs, None))
        self.text_len[index], self.tokens[index] = max(prev_len, len(text)), max(prev_tokens, upto)
        if reason:
            chunks.append(self._chunk(index, {} if self.req.chat else "", None, reason))
            meta = result["meta_info"]
            self.prompt_tokens[index // self.req.n] = meta["prompt_tokens"]
            self.completion_tokens += meta["completion_tokens"]
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        """The final chunk of `stream_options.include_usage`."""
        return {**self.env, "choices": [], "usage": usage(sum(self.prompt_tokens.values()), self.completion_tokens)}


async def merge_streams(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """(index, result) from several streams as they arrive; closing this closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, it: AsyncIterator[dict]) -> None:
        try:
            async for r in it:
                queue.put_nowait((i, r))
        except Exception as e:   # handed to the consumer
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
        streams.append(await state.open_stream(
            rid, **{key: req.prompts[j]}, sampling_params=params, return_logprob=req.logprobs is not None,
            top_logprobs_num=req.logprobs or 0, return_text_in_logprobs=True))
    return streams


async def _stream(state: ServerState, req: OpenAIRequest) -> Response:
    rids = [f"{req.rid}-{k}" for k in range(len(req.prompts) * req.n)]
    hold = state.admit(rids, {req.rid: rids})   # the response id aborts every choice
    try:
        streams = await _open_streams(state, req, rids)
    except BaseException:
        hold.close()
        raise
    return EventStream(_events(state, req, hold, rids, streams), hold)


async def _events(state: ServerState, req: OpenAIRequest, hold: Hold, rids: list[str],
                  streams: list[AsyncIterator[dict]]) -> AsyncIterator[str]:
    shaper = StreamShaper(req, state)
    timers = [StreamTimer(state.metrics, hold.start) for _ in rids]
    merged = merge_streams(streams)
    try:
        async for idx, result in merged:
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
        yield sse(e.body())
    except Exception:
        logger.exception("stream %s failed", req.rid)
        yield sse(ApiError(500, "internal error while streaming").body())
    finally:
        await merged.aclose()
    yield SSE_DONE


# --- routes -----------------------------------------------------------------------------------
async def handle_openai(state: ServerState, request: Request, chat: bool) -> Response:
    """POST /v1/completions (chat=False) and /v1/chat/completions (chat=True)."""
    req = parse_openai(state, await read_json(request), chat)
    if req.stream:
        return await _stream(state, req)
    return await _complete(state, request, req)


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    """The OpenAI-compatible routes."""

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": state.served_model_name, "object": "model", "created": 0, "owned_by": "plait",
                "root": state.model_path, "max_model_len": state.context_len}
        return json_response({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle_openai(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle_openai(state, request, chat=True)
