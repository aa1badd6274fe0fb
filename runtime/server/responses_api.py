"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`), which the openai SDK's
`responses.create` and the openai Agents SDK call, translated onto the chat-completions path (same
chat template, sampling, response formats, tool-call constraints and parsing).

Responses are kept in memory for `previous_response_id` (the last STORED_RESPONSES of them, unless
a request says `store: false`); a follow-up request continues that conversation: its input, and
the function calls it made, before the new input."""

from __future__ import annotations

import collections
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Path, Request, Response

from . import chat_adapter
from .api_schema import responses
from .http_common import ApiError, json_response, read_json, sse
from .openai_request import OpenAIRequest, parse_openai
from .openai_response import chat_message, finish_reason
from .openai_stream import StreamShaper
from .server_state import ServerState

STORED_RESPONSES = 1024  # previous_response_id looks back this many responses (oldest dropped first)


class ResponseStore:
    """The last `size` responses: their object (GET /v1/responses/{id}) and their conversation as chat
    messages, the assistant's turn included (previous_response_id)."""

    def __init__(self, size: int = STORED_RESPONSES):
        self.size = size
        self.items: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self.items[response["id"]] = (response, conversation)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict]]:
        if rid not in self.items:
            raise ApiError(404, f"no response {rid!r} is stored on this server (it keeps the last {self.size})")
        return self.items[rid]


# --- request: Responses -> chat completions -----------------------------------------------------------
def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            if not (
                isinstance(p, dict)
                and p.get("type") in ("input_text", "output_text", "text")
                and isinstance(p.get("text"), str)
            ):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise ApiError(400, f"{where}.{i}: content part type {kind!r} is not supported (text only)")
            parts.append(p["text"])
        return "".join(parts)
    raise ApiError(400, f"{where} must be a string or a list of content parts")


def input_messages(items: Any) -> list[dict[str, Any]]:
    """`input` (a string, or message / function_call / function_call_output items) as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "input must be a string or a non-empty list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "assistant", "system", "developer"):
            out.append({"role": item["role"], "content": _text(item.get("content"), f"input.{i}.content")})
        elif kind == "function_call" and isinstance(item.get("name"), str):
            call = {
                "id": str(item.get("call_id") or ""),
                "type": "function",
                "function": {"name": item["name"], "arguments": str(item.get("arguments") or "{}")},
            }
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(item.get("call_id") or ""),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(
                400, f"input.{i}: item type {kind!r} is not supported (message, function_call, function_call_output)"
            )
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise ApiError(400, "tools must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise ApiError(400, f"tools.{i}: tool type {kind!r} is not supported (function tools only)")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def to_chat(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """A Responses request body (after `history`, the previous response's conversation) as a chat body."""
    if "input" not in body:
        raise ApiError(400, "input: field required")
    messages = list(history) + input_messages(body["input"])
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise ApiError(400, "instructions must be a string")
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    chat: dict[str, Any] = {"messages": messages, "stream": body.get("stream", False)}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt},
        }
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ApiError(400, "text.format.type must be 'text', 'json_schema' or 'json_object'")
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    return chat


# --- response --------------------------------------------------------------------------------------
def _usage(result: dict[str, Any]) -> dict[str, Any]:
    meta = result["meta_info"]
    return {
        "input_tokens": meta["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": meta["cached_tokens"]},
        "output_tokens": meta["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"],
    }


def _text_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}] if text or status == "completed" else [],
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class ResponseBuilder:
    """The response object of one request, from its body and (when finished) its output items."""

    def __init__(self, state: ServerState, body: dict[str, Any], chat: dict[str, Any]):
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = state.served_model_name
        self.body = body
        self.chat = chat

    def object(self, status: str, output: list[dict[str, Any]], result: dict[str, Any] | None) -> dict[str, Any]:
        b = self.body
        length = result is not None and (result["meta_info"].get("finish_reason") or {}).get("type") == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if length else status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if length else None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "temperature": b.get("temperature"),
            "top_p": b.get("top_p"),
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "store": b.get("store", True),
            "text": b.get("text") or {"format": {"type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "metadata": b.get("metadata") or {},
            "usage": _usage(result) if result is not None else None,
        }

    def conversation(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages of this exchange, its output as the assistant's turn (for the store)."""
        text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in output
            if item["type"] == "function_call"
        ]
        turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            turn["tool_calls"] = calls
        return [m for m in self.chat["messages"]] + [turn]


def output_items(req: OpenAIRequest, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items of a finished request: its text as a message, then its function calls."""
    msg, _ = chat_message(req, result["text"], finish_reason(result))
    out = []
    if msg.get("content"):
        out.append(_text_item("msg_" + uuid.uuid4().hex, msg["content"]))
    for call in msg.get("tool_calls") or []:
        out.append(
            _call_item("fc_" + uuid.uuid4().hex, call["id"], call["function"]["name"], call["function"]["arguments"])
        )
    return out


def _event(data: dict[str, Any]) -> str:
    return f"event: {data['type']}\n" + sse(data)


class ResponseStream:
    """Chat-completion chunks of one choice -> the Responses API's typed events: an output message
    whose text streams as `response.output_text.delta`, then a function_call item per call whose
    arguments stream as `response.function_call_arguments.delta`; `response.completed` (or
    `.incomplete`) carries the whole response."""

    def __init__(self, state: ServerState, req: OpenAIRequest, builder: ResponseBuilder, store: ResponseStore | None):
        self.shaper = StreamShaper(req, state)
        self.builder = builder
        self.store = store
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being written

    def _e(self, kind: str, **data: Any) -> str:
        self.seq += 1
        return _event({"type": kind, "sequence_number": self.seq - 1, **data})

    def start(self) -> list[str]:
        obj = self.builder.object("in_progress", [], None)
        return [self._e("response.created", response=obj), self._e("response.in_progress", response=obj)]

    def _index(self) -> int:
        return len(self.output)

    def _close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx, out = self._index(), []
        if item["type"] == "message":
            text = item["text"]
            done = _text_item(item["id"], text)
            part = done["content"][0]
            out += [
                self._e("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text),
                self._e("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part),
            ]
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], item["arguments"])
            out.append(
                self._e(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=idx,
                    arguments=item["arguments"],
                )
            )
        out.append(self._e("response.output_item.done", output_index=idx, item=done))
        self.output.append(done)
        return out

    def _open_text(self) -> list[str]:
        out = self._close()
        self.open = {"type": "message", "id": "msg_" + uuid.uuid4().hex, "text": ""}
        idx = self._index()
        return out + [
            self._e(
                "response.output_item.added", output_index=idx, item=_text_item(self.open["id"], "", "in_progress")
            ),
            self._e(
                "response.content_part.added",
                item_id=self.open["id"],
                output_index=idx,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": []},
            ),
        ]

    def _open_call(self, call_id: str, name: str) -> list[str]:
        out = self._close()
        self.open = {
            "type": "function_call",
            "id": "fc_" + uuid.uuid4().hex,
            "call_id": call_id,
            "name": name,
            "arguments": "",
        }
        return out + [
            self._e(
                "response.output_item.added",
                output_index=self._index(),
                item=_call_item(self.open["id"], call_id, name, "", "in_progress"),
            )
        ]

    def update(self, result: dict[str, Any]) -> list[str]:
        """Events for one new cumulative result."""
        out: list[str] = []
        for kind, value in chat_adapter.stream_parts(self.shaper, result):
            if kind == "text":
                if self.open is None or self.open["type"] != "message":
                    out += self._open_text()
                self.open["text"] += value
                out.append(
                    self._e(
                        "response.output_text.delta",
                        item_id=self.open["id"],
                        output_index=self._index(),
                        content_index=0,
                        delta=value,
                    )
                )
            elif kind == "call":
                out += self._open_call(*value)
            elif kind == "arguments":
                self.open["arguments"] += value
                out.append(
                    self._e(
                        "response.function_call_arguments.delta",
                        item_id=self.open["id"],
                        output_index=self._index(),
                        delta=value,
                    )
                )
            else:
                out += self._close()
                obj = self.builder.object("completed", self.output, result)
                if self.store is not None:
                    self.store.put(obj, self.builder.conversation(self.output))
                out.append(
                    self._e(
                        "response.completed" if obj["status"] == "completed" else "response.incomplete", response=obj
                    )
                )
        return out


# --- routes ---------------------------------------------------------------------------------------
async def _create(state: ServerState, store: ResponseStore, request: Request) -> Response:
    body = await read_json(request)
    state.log_request(request.url.path, body)
    history: list[dict[str, Any]] = []
    if body.get("previous_response_id") is not None:
        history = store.get(str(body["previous_response_id"]))[1]
    chat = to_chat(body, history)
    req = parse_openai(state, chat, chat=True)
    builder = ResponseBuilder(state, body, chat)
    keep = store if body.get("store", True) is not False else None
    if req.stream:
        shaper = ResponseStream(state, req, builder, keep)
        return await chat_adapter.stream(
            state,
            request,
            req,
            "responses",
            shaper.start(),
            shaper.update,
            lambda e: _event(
                {"type": "error", "code": e.code, "message": e.message, "param": None, "sequence_number": shaper.seq}
            ),
        )
    result = await chat_adapter.complete(state, request, req, "responses")
    output = output_items(req, result)
    obj = builder.object("completed", output, result)
    if keep is not None:
        keep.put(obj, builder.conversation(output))
    return json_response(obj)


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/responses and GET /v1/responses/{response_id}."""
    store = ResponseStore()

    @app.post("/v1/responses", responses=responses({"type": "object"}, stream=True))
    async def create_response(request: Request) -> Response:
        return await _create(state, store, request)

    @app.get("/v1/responses/{response_id}", responses=responses({"type": "object"}))
    async def get_response(response_id: str = Path(pattern=r"^resp_[0-9a-f]+$")) -> Response:
        return json_response(store.get(response_id)[0])
