"""OpenAI response shapes from engine results: finish reasons, logprobs, messages (tool calls
included), choices, usage.
"""

from __future__ import annotations

from typing import Any

from .http_common import abort_error, is_int
from .openai_request import OpenAIRequest
from .reasoning import split_reasoning
from .server_state import ServerState
from .tool_calls import forced_calls, parse_tool_calls, tool_call_objects


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


def result_logprobs(result: dict[str, Any], start: int, end: int) -> list[tuple[str, float, list]]:
    """(text, logprob, [(text, logprob), ...]) for output positions [start, end)."""
    meta = result["meta_info"]
    lps = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    out = []
    for k in range(start, min(end, len(lps))):
        lp, _, text = lps[k]
        top = tops[k] if k < len(tops) and tops[k] else []
        out.append((text or "", lp, [(t or "", v) for v, _, t in top]))
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
    return {
        "tokens": [t for t, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [{tt: tl for tt, tl in top} for _, _, top in entries] if k else None,
        "text_offset": offsets,
    }


def chat_message(req: OpenAIRequest, text: str, reason: str) -> tuple[dict[str, Any], str]:
    """The assistant message of a finished chat choice and its finish reason (the reasoning section
    split off with a reasoning parser, tool calls read out of the rest when the request has tools)."""
    if req.reasoning is not None:
        reasoning, text = split_reasoning(req.reasoning, text)
        message, reason = _answer(req, text, reason)
        return ({**message, "reasoning_content": reasoning} if reasoning is not None else message), reason
    return _answer(req, text, reason)


def _answer(req: OpenAIRequest, text: str, reason: str) -> tuple[dict[str, Any], str]:
    plan = req.tools
    content: str | None = text
    calls: list[dict[str, str]] | None = None
    if plan is not None and plan.constrained:
        calls = forced_calls(plan, text) if reason == "stop" else None
        if calls:
            content = None
    elif plan is not None:
        content, calls = parse_tool_calls(text, plan.names, plan.fmt)
    if not calls:
        return {"role": "assistant", "content": text}, reason
    return {"role": "assistant", "content": content, "tool_calls": tool_call_objects(calls)}, "tool_calls"


def openai_choice(req: OpenAIRequest, index: int, result: dict[str, Any]) -> dict[str, Any]:
    reason = finish_reason(result)
    entries = result_logprobs(result, 0, visible_tokens(result)) if req.logprobs is not None else None
    if req.chat:
        message, reason = chat_message(req, result["text"], reason)
        return {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(entries) if entries is not None else None,
            "finish_reason": reason,
        }
    return {
        "index": index,
        "text": result["text"],
        "finish_reason": reason,
        "logprobs": completion_logprobs(entries, 0, req.logprobs) if entries is not None else None,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI `usage`; `prompt_tokens_details.cached_tokens`: prompt tokens read from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def cached_prompt_tokens(results: list[dict[str, Any]]) -> int:
    """Cached tokens of one prompt's n samples: the fewest any of them read from the cache, i.e. what
    was cached before this request (the samples after the first read the prompt it computed)."""
    return min(r["meta_info"]["cached_tokens"] for r in results)


def envelope(req: OpenAIRequest, state: ServerState, created: int, chunk: bool) -> dict[str, Any]:
    obj = req.object + (".chunk" if chunk and req.chat else "")
    return {"id": req.rid, "object": obj, "created": created, "model": state.served_model_name}
