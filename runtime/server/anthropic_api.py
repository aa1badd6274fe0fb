"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), as the `anthropic` SDK
and Claude-style agent tools call it, translated onto the chat-completions path: the same chat
template, tool-call constraints and parsing, sampling and engine requests. Errors come in
Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`); the API key is taken from
`x-api-key` as well as `Authorization: Bearer`."""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import FastAPI, Request, Response

from . import chat_adapter
from .api_schema import AnthropicErrorResponse, responses
from .http_common import ApiError, json_response, read_json
from .openai_request import OpenAIRequest, parse_openai
from .openai_response import chat_message, finish_reason
from .openai_stream import StreamShaper
from .server_state import ServerState

# Anthropic's error `type` per HTTP status
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "api_error",
}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_body(e: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def error_response(e: ApiError) -> Response:
    return json_response(error_body(e), e.status, e.headers)


# --- request: Messages -> chat completions ------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content
    ):
        return "".join(b["text"] for b in content)
    raise ApiError(400, f"{where} must be a string or a list of text blocks")


def _messages(messages: Any) -> list[dict[str, Any]]:
    """Anthropic messages (text / tool_use / tool_result blocks) as OpenAI chat messages."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: a non-empty list is required")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"messages.{i}: role must be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"messages.{i}.content must be a string or a list of content blocks")
        text, calls = [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_use" and m["role"] == "assistant" and isinstance(b.get("name"), str):
                calls.append(
                    {
                        "id": str(b.get("id") or ""),
                        "type": "function",
                        "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})},
                    }
                )
            elif kind == "tool_result" and m["role"] == "user":
                result = _text_of(b.get("content", ""), f"messages.{i}.content.{j}.content")
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": str(b.get("tool_use_id") or ""),
                        "content": ("Error: " if b.get("is_error") else "") + result,
                    }
                )
            else:
                raise ApiError(
                    400,
                    f"messages.{i}.content.{j}: unsupported content block type {kind!r} "
                    f"for role {m['role']!r} (text, tool_use and tool_result are supported)",
                )
        if calls:
            out.append({"role": "assistant", "content": "".join(text) or None, "tool_calls": calls})
        elif text or m["role"] == "assistant":
            out.append({"role": m["role"], "content": "".join(text)})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """Anthropic tool_choice -> (OpenAI tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ApiError(400, "tool_choice.type must be one of 'auto', 'any', 'tool', 'none'")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    if choice["type"] == "tool":
        if not isinstance(choice.get("name"), str):
            raise ApiError(400, "tool_choice.name: a tool name is required for type 'tool'")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice["type"]], parallel


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Messages request body as a chat-completions body (400 for what the Messages API rejects)."""
    for name in ("model", "max_tokens", "messages"):
        if name not in body:
            raise ApiError(400, f"{name}: field required")
    if not isinstance(body["max_tokens"], int) or isinstance(body["max_tokens"], bool) or body["max_tokens"] < 1:
        raise ApiError(400, "max_tokens must be an integer >= 1")
    messages = _messages(body["messages"])
    if body.get("system") is not None:
        messages.insert(0, {"role": "system", "content": _text_of(body["system"], "system")})
    chat: dict[str, Any] = {
        "model": body["model"],
        "messages": messages,
        "max_tokens": body["max_tokens"],
        "stream": body.get("stream", False),
    }
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools
        ):
            raise ApiError(400, "tools must be a list of {name, description, input_schema}")
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema") or {"type": "object"},
                },
            }
            for t in tools
        ]
    fmt = (body.get("output_config") or {}).get("format") if isinstance(body.get("output_config"), dict) else None
    fmt = fmt or body.get("output_format")
    if fmt is not None:
        if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
            raise ApiError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    choice, parallel = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    return chat


# --- response: chat results -> a Message ----------------------------------------------------------
def _stop(result: dict[str, Any], reason: str, stop_sequences: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    matched = (result["meta_info"].get("finish_reason") or {}).get("matched")
    if reason == "stop" and isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return _STOP_REASONS.get(reason, "end_turn"), None


def _usage(result: dict[str, Any]) -> dict[str, int]:
    meta = result["meta_info"]
    return {
        "input_tokens": meta["prompt_tokens"],
        "output_tokens": meta["completion_tokens"],
        "cache_read_input_tokens": meta["cached_tokens"],
        "cache_creation_input_tokens": 0,
    }


def message(
    state: ServerState, req: OpenAIRequest, result: dict[str, Any], stop_sequences: list[str], mid: str
) -> dict[str, Any]:
    """The Message of a finished request."""
    msg, reason = chat_message(req, result["text"], finish_reason(result))
    content: list[dict[str, Any]] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"]),
            }
        )
    stop_reason, stop_sequence = _stop(result, reason, stop_sequences)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": state.served_model_name,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(result),
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class MessageStream:
    """Chat-completion chunks of one choice -> Messages API events: a text block, then one
    tool_use block per call, whose arguments stream as `input_json_delta`s."""

    def __init__(self, state: ServerState, req: OpenAIRequest, stop_sequences: list[str], mid: str):
        self.shaper = StreamShaper(req, state)
        self.stop_sequences = stop_sequences
        self.mid = mid
        self.model = state.served_model_name
        self.block = -1  # index of the open content block
        self.kind: str | None = None  # its type

    def start(self) -> list[str]:
        return [
            _event(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": self.mid,
                        "type": "message",
                        "role": "assistant",
                        "model": self.model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {"input_tokens": 0, "output_tokens": 0},
                    },
                },
            )
        ]

    def _open(self, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.block += 1
        self.kind = block["type"]
        out.append(
            _event("content_block_start", {"type": "content_block_start", "index": self.block, "content_block": block})
        )
        return out

    def _close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.block})]

    def _delta(self, delta: dict[str, Any]) -> list[str]:
        return [_event("content_block_delta", {"type": "content_block_delta", "index": self.block, "delta": delta})]

    def update(self, result: dict[str, Any]) -> list[str]:
        """Events for one new cumulative result."""
        out: list[str] = []
        for kind, value in chat_adapter.stream_parts(self.shaper, result):
            if kind == "text":
                if self.kind != "text":
                    out += self._open({"type": "text", "text": ""})
                out += self._delta({"type": "text_delta", "text": value})
            elif kind == "call":
                out += self._open({"type": "tool_use", "id": value[0], "name": value[1], "input": {}})
            elif kind == "arguments":
                out += self._delta({"type": "input_json_delta", "partial_json": value})
            else:
                stop_reason, stop_sequence = _stop(result, value, self.stop_sequences)
                out += self._close()
                out.append(
                    _event(
                        "message_delta",
                        {
                            "type": "message_delta",
                            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            "usage": _usage(result),
                        },
                    )
                )
                out.append(_event("message_stop", {"type": "message_stop"}))
        return out


# --- routes ---------------------------------------------------------------------------------------
async def _create(state: ServerState, request: Request) -> Response:
    body = await read_json(request)
    state.log_request(request.url.path, body)
    chat = to_chat(body)
    req = parse_openai(state, chat, chat=True)
    stop_sequences = [s for s in chat.get("stop") or [] if isinstance(s, str)]
    mid = "msg_" + uuid.uuid4().hex
    if req.stream:
        shaper = MessageStream(state, req, stop_sequences, mid)
        return await chat_adapter.stream(
            state, request, req, "messages", shaper.start(), shaper.update, lambda e: _event("error", error_body(e))
        )
    result = await chat_adapter.complete(state, request, req, "messages")
    return json_response(message(state, req, result, stop_sequences, mid))


def count_tokens(state: ServerState, body: dict[str, Any]) -> dict[str, int]:
    """{"input_tokens": N}: the prompt a Messages request with this body would have."""
    chat = to_chat({"max_tokens": 1, **body})
    req = parse_openai(state, {**chat, "stream": False}, chat=True)
    return {"input_tokens": len(req.prompts[0])}


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/messages and /v1/messages/count_tokens."""

    @app.post("/v1/messages", responses=responses({"type": "object"}, stream=True, error=AnthropicErrorResponse))
    async def messages(request: Request) -> Response:
        try:
            return await _create(state, request)
        except ApiError as e:
            state.metrics.count_request("messages", e.status)
            return error_response(e)

    @app.post("/v1/messages/count_tokens", responses=responses({"type": "object"}, error=AnthropicErrorResponse))
    async def messages_count_tokens(request: Request) -> Response:
        try:
            return json_response(count_tokens(state, await read_json(request)))
        except ApiError as e:
            return error_response(e)
