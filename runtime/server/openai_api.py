"""OpenAI-compatible routes over the engine: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Requests are translated into engine calls (sampling params in the native protocol's names) and
results into OpenAI's shapes. finish reasons map `{"type": "stop"}` -> "stop" and
`{"type": "length"}` -> "length"; an abort is an error. Extensions accepted as in SGLang: top_k,
min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, no_stop_trim,
skip_special_tokens.

Structured output: `response_format` (text / json_object, with llama.cpp's optional `schema` /
json_schema / structural_tag), the extra body fields `regex`, `ebnf`, `json_schema`, `choice`,
`structural_tag` (vLLM's `guided_*` names too) and vLLM's `structured_outputs` object (json /
regex / choice / grammar / json_object / structural_tag), at most one per request, become the
engine's grammar; a grammar that does not compile is a 400 "invalid grammar: ...", and a
constraint-like field plait does not enforce (`guided_whitespace_pattern`, ...) a 400 naming it.

Parsing is in `openai_request.py`, tools in `openai_tools.py` and `tool_calls.py`, result shapes
in `openai_response.py`, streaming in `openai_stream.py`.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from starlette.responses import Response

from .api_schema import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    json_body,
    ref,
    responses,
)
from .http_common import json_response, read_json
from .native_api import expand_rids
from .openai_request import OpenAIRequest, engine_prompts, parse_openai
from .openai_response import cached_prompt_tokens, envelope, openai_choice, usage
from .openai_stream import stream_response
from .server_state import ServerState


async def _complete(state: ServerState, request: Request, req: OpenAIRequest) -> Response:
    item_rids = [f"{req.rid}-{j}" for j in range(len(req.prompts))]
    endpoint = "chat" if req.chat else "completions"
    rids = expand_rids(item_rids, [req.n] * len(item_rids))
    with state.admit(rids, {req.rid: rids}) as hold:
        results = await state.generate(
            request,
            hold,
            endpoint,
            **engine_prompts(req),
            sampling_params=req.params,
            rid=item_rids,
            return_logprob=req.logprobs is not None,
            top_logprobs_num=req.logprobs or 0,
            return_text_in_logprobs=True,
        )
    choices = [openai_choice(req, i, r) for i, r in enumerate(results)]
    prompt_tokens = sum(results[j * req.n]["meta_info"]["prompt_tokens"] for j in range(len(req.prompts)))
    completion_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    cached = sum(cached_prompt_tokens(results[j * req.n : (j + 1) * req.n]) for j in range(len(req.prompts)))
    return json_response(
        {
            **envelope(req, state, int(time.time()), False),
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached),
        }
    )


# --- routes -----------------------------------------------------------------------------------
async def handle_openai(state: ServerState, request: Request, chat: bool) -> Response:
    """POST /v1/completions (chat=False) and /v1/chat/completions (chat=True)."""
    body = await read_json(request)
    state.log_request(request.url.path, body)
    req = parse_openai(state, body, chat)
    if req.stream:
        return await stream_response(state, request, req)
    return await _complete(state, request, req)


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    """The OpenAI-compatible routes."""

    @app.get("/v1/models", responses=responses({"type": "object"}))
    async def models() -> Response:
        card = {
            "id": state.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "plait",
            "root": state.model_path,
            "max_model_len": state.context_len,
        }
        return json_response({"object": "list", "data": [card]})

    @app.post(
        "/v1/completions",
        openapi_extra=json_body(CompletionRequest),
        responses=responses(ref(CompletionResponse), stream=True),
    )
    async def completions(request: Request) -> Response:
        return await handle_openai(state, request, chat=False)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=json_body(ChatCompletionRequest),
        responses=responses(ref(ChatCompletionResponse), stream=True),
    )
    async def chat_completions(request: Request) -> Response:
        return await handle_openai(state, request, chat=True)
