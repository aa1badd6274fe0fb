"""/tokenize and /detokenize, in vLLM's request and response shapes (llama.cpp's server has the
same pair): a client counts or inspects tokens with the served model's own tokenizer and chat
template, without generating."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, Response

from .api_schema import responses
from .http_common import ApiError, json_response, read_json
from .server_state import ServerState


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a bool, got {type(value).__name__}")
    return value


def tokenize(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    """{"prompt": str} (with `add_special_tokens`, default true) or {"messages": [...]} (through the
    chat template, generation prompt appended) -> {"count", "max_model_len", "tokens"} and, with
    `return_token_strs`, "token_strs"."""
    from .openai_tools import render_chat, template_kwargs

    tokenizer = state.engine.tokenizer
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "give exactly one of prompt (a string) or messages (a chat)")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise ApiError(400, "prompt must be a string")
        ids = tokenizer(body["prompt"], add_special_tokens=_bool(body, "add_special_tokens", True)).input_ids
    else:
        ids = render_chat(tokenizer, body["messages"], body.get("tools"), template_kwargs(body))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.context_len, "tokens": ids}
    if _bool(body, "return_token_strs", False):
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    """{"tokens": [int, ...]} -> {"prompt": the text}; 400 for ids outside the vocabulary."""
    tokens = body.get("tokens")
    vocab = len(state.engine.tokenizer)
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(400, "tokens must be a list of token ids")
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return {"prompt": state.engine.tokenizer.decode(tokens)}


def add_tokenize_routes(app: FastAPI, state: ServerState) -> None:
    """POST /tokenize and /detokenize."""

    @app.post("/tokenize", responses=responses({"type": "object"}))
    async def tokenize_route(request: Request) -> Response:
        return json_response(tokenize(state, await read_json(request)))

    @app.post("/detokenize", responses=responses({"type": "object"}))
    async def detokenize_route(request: Request) -> Response:
        return json_response(detokenize(state, await read_json(request)))
