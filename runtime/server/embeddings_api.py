"""OpenAI's `/v1/embeddings` from the served model: each input's last-token final hidden state,
L2-normalized (`Engine.encode`), computed as prefill-only requests through the same scheduler,
batches and prefix cache as generation. `encoding_format` "float" or "base64" (little-endian
float32, what the openai SDK asks for by default)."""

from __future__ import annotations

import base64
import struct
import uuid
from typing import Any

from fastapi import FastAPI, Request, Response

from .api_schema import responses
from .http_common import ApiError, is_int, json_response, read_json
from .server_state import ServerState

MAX_INPUTS = 2048  # items in one request, as OpenAI allows


def _inputs(value: Any) -> tuple[str, list]:
    """`input` as ("prompt", [str, ...]) or ("input_ids", [[int, ...], ...])."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(is_int(t) for t in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "input must be a string, a list of strings, a list of token ids or a list of those")
    if len(value) > MAX_INPUTS:
        raise ApiError(400, f"input takes at most {MAX_INPUTS} items, got {len(value)}")
    if all(isinstance(v, str) for v in value):
        if any(not v for v in value):
            raise ApiError(400, "input must not contain empty strings")
        return "prompt", value
    if all(isinstance(v, list) and v and all(is_int(t) for t in v) for v in value):
        return "input_ids", value
    raise ApiError(400, "input must be a string, a list of strings, a list of token ids or a list of those")


def _encoded(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


async def embeddings(state: ServerState, request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """The `/v1/embeddings` answer for `body`."""
    state.check_model(body)
    key, items = _inputs(body.get("input"))
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ApiError(400, f"encoding_format must be 'float' or 'base64', got {fmt!r}")
    width = state.engine.hidden_size
    dims = body.get("dimensions")
    if dims is not None and dims != width:
        raise ApiError(
            400,
            f"dimensions {dims!r} is not supported: this model's embeddings have {width} "
            "dimensions (leave dimensions out)",
        )
    rid = "embd-" + uuid.uuid4().hex
    rids = [f"{rid}-{i}" for i in range(len(items))]
    with state.admit(rids, {rid: rids}) as hold:
        out = await state.generate(
            request, hold, "embeddings", **{key: items}, sampling_params={"max_new_tokens": 0}, rid=rids, _embed=True
        )
    prompt_tokens = sum(r["meta_info"]["prompt_tokens"] for r in out)
    return {
        "object": "list",
        "model": state.served_model_name,
        "data": [
            {"object": "embedding", "index": i, "embedding": _encoded(r["embedding"], fmt)} for i, r in enumerate(out)
        ],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def add_embeddings_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/embeddings."""

    @app.post("/v1/embeddings", responses=responses({"type": "object"}))
    async def create_embeddings(request: Request) -> Response:
        body = await read_json(request)
        state.log_request(request.url.path, body)
        return json_response(await embeddings(state, request, body))
