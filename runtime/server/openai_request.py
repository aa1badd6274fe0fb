"""Parsing an OpenAI completions or chat request into engine calls: sampling params, the one
structured-output constraint, prompts, max_tokens defaults.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from ..sampling_params import MAX_INT, MAX_N
from .api_schema import MAX_TOP_LOGPROBS
from .http_common import ApiError, is_int
from .openai_fields import is_bool, require_schema, typed_field
from .openai_tools import (
    ToolPlan,
    parse_tools,
    render_chat,
    tag_json,
    template_kwargs,
    template_source,
    tool_call_schema,
    tool_call_tags,
)
from .reasoning import reasoning_gate
from .server_state import ServerState
from .tool_parsers import tool_call_format

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API
# OpenAI-side name -> sampling parameter, for the extensions passed through.
EXTRA_PARAMS = {
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
    "no_stop_trim": "no_stop_trim",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "json_max_number_digits": "json_max_number_digits",
    "json_max_string_length": "json_max_string_length",
}
# Grammar constraints in the body (SGLang's names, `choice`, and vLLM's guided_* names) -> the
# sampling parameter; at most one per request, counting response_format and a forced tool call.
CONSTRAINT_FIELDS = {
    "regex": "regex",
    "ebnf": "ebnf",
    "json_schema": "json_schema",
    "choice": "choices",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
    "guided_json": "json_schema",
    "guided_choice": "choices",
    "structural_tag": "structural_tag",
}
GRAMMAR_PARAMS = ("regex", "ebnf", "json_schema", "choices", "structural_tag")
# SGLang's grammars over the whole output text: with a reasoning parser they still bind from the
# first token (they may spell out the <think> section); every other constraint describes the
# answer and binds after the section.
RAW_GRAMMAR_FIELDS = frozenset({"regex", "ebnf"})
# vLLM's `structured_outputs` object: its keys -> the sampling parameter (json_object: any object)
STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choices",
    "grammar": "ebnf",
    "json_object": "json_schema",
    "structural_tag": "structural_tag",
}
# Its options that change nothing here (plait never falls back to unconstrained text)
STRUCTURED_OPTIONS = ("disable_fallback",)
# Constraint-like fields other servers take that plait does not enforce: a 400 naming them, never
# an answer that silently ignores them.
UNSUPPORTED_CONSTRAINTS = ("guided_whitespace_pattern", "whitespace_pattern")


@dataclasses.dataclass
class OpenAIRequest:
    """A parsed completions or chat request."""

    chat: bool
    prompts: list[str | list[int]]  # text or token ids, one per prompt
    params: list[dict[str, Any]]  # sampling params per prompt (n included)
    n: int
    logprobs: int | None  # top-k count when logprobs are asked for, else None
    stream: bool
    include_usage: bool
    rid: str  # also the response id
    tools: ToolPlan | None = None  # chat with tools the model may call (not "none")
    reasoning: str | None = None  # the reasoning parser splitting a chat answer's <think> section

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


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
    if body.get("functions"):
        raise ApiError(400, "the legacy functions / function_call fields are not supported; use tools / tool_choice")


def _response_format(body: dict[str, Any]) -> tuple[str, str] | None:
    """response_format -> (the grammar's sampling parameter, its value) (None: free text)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "structural_tag":
        return "structural_tag", _structural_tag(fmt, "response_format")
    if kind == "json_object":  # llama.cpp's server (and instructor's JSON_SCHEMA mode) may add a schema
        schema = fmt.get("schema")
        if schema is None:
            return "json_schema", json.dumps({"type": "object"})
        require_schema(schema, "response_format.schema")
        return "json_schema", json.dumps(schema)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ApiError(400, "response_format.json_schema must be an object with name and schema")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object")
        require_schema(schema, "response_format.json_schema.schema")
        return "json_schema", json.dumps(schema)
    raise ApiError(
        400,
        "response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag'"
        + (f", got {kind!r} (not supported)" if isinstance(kind, str) else ""),
    )


def _structural_tag(value: Any, where: str) -> str:
    """A structural tag as xgrammar reads it (JSON text): `{"type": "structural_tag", "format":
    {...}}`, or the older form vLLM and SGLang accept (`structures` of begin / schema / end, and
    `triggers`), rewritten as triggered tags. The format itself is checked when it compiles."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ApiError(400, f"{where} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{where} must be a structural tag object")
    if isinstance(value.get("format"), dict):
        return json.dumps({"type": "structural_tag", "format": value["format"]})
    structures, triggers = value.get("structures"), value.get("triggers")
    if not (
        isinstance(structures, list)
        and structures
        and isinstance(triggers, list)
        and triggers
        and all(isinstance(t, str) and t for t in triggers)
    ):
        raise ApiError(400, f"{where} must have a 'format', or 'structures' and 'triggers'")
    tags = []
    for i, st in enumerate(structures):
        if not (isinstance(st, dict) and isinstance(st.get("begin"), str) and isinstance(st.get("end"), str)):
            raise ApiError(400, f"{where}.structures[{i}] must have begin, schema and end")
        schema = st.get("schema", {})
        require_schema(schema, f"{where}.structures[{i}].schema")
        tags.append(
            {
                "type": "tag",
                "begin": st["begin"],
                "end": st["end"],
                "content": {"type": "json_schema", "json_schema": schema},
            }
        )
    return json.dumps(
        {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
    )


def _constraint_value(name: str, param: str, value: Any) -> Any:
    """Type-check one grammar field of the body; a json_schema may be a string or the schema."""
    if param in ("regex", "ebnf"):
        if not isinstance(value, str) or not value:
            raise ApiError(400, f"{name} must be a non-empty string")
        return value
    if param == "structural_tag":
        return _structural_tag(value, name)
    if param == "choices":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise ApiError(400, f"{name} must be a non-empty list of non-empty strings")
        return list(value)
    if isinstance(value, (dict, bool)):
        schema = value
    elif isinstance(value, str):
        try:
            schema = json.loads(value)
        except ValueError as e:
            raise ApiError(400, f"{name} is not valid JSON: {e}") from None
    else:
        raise ApiError(400, f"{name} must be a JSON schema (an object or its JSON text)")
    require_schema(schema, name)
    return json.dumps(schema)


def _structured_outputs(body: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """vLLM's `structured_outputs` object -> (label, sampling parameter, value) per constraint in
    it; 400 for a key plait does not enforce."""
    so = body.get("structured_outputs")
    if so is None:
        return []
    if not isinstance(so, dict):
        raise ApiError(400, "structured_outputs must be an object")
    unknown = sorted(
        k
        for k, v in so.items()
        if k not in STRUCTURED_OUTPUTS and k not in STRUCTURED_OPTIONS and v not in (None, False)
    )
    if unknown:
        raise ApiError(
            400, f"structured_outputs.{unknown[0]} is not supported (supported: {', '.join(STRUCTURED_OUTPUTS)})"
        )
    found = []
    for key, param in STRUCTURED_OUTPUTS.items():
        value = so.get(key)
        if value is None or value is False:
            continue
        label = f"structured_outputs.{key}"
        if key == "json_object":
            found.append((label, param, json.dumps({"type": "object"})))
        else:
            found.append((label, param, _constraint_value(label, param, value)))
    return found


def _constraints(body: dict[str, Any], plan: ToolPlan | None) -> dict[str, Any]:
    """The grammar sampling parameter of the request ({} for none); 400 for more than one, and
    for a constraint-like field plait does not enforce."""
    for name in UNSUPPORTED_CONSTRAINTS:
        if body.get(name) not in (None, False, ""):
            raise ApiError(
                400,
                f"{name} is not supported: plait enforces response_format, structured_outputs "
                "(json, regex, choice, grammar, json_object, structural_tag), regex, ebnf, json_schema, "
                "structural_tag and choice",
            )
    found: list[tuple[str, str, Any]] = []
    fmt = _response_format(body)
    if fmt is not None:
        found.append(("response_format", *fmt))
    for name, param in CONSTRAINT_FIELDS.items():
        if body.get(name) is not None:
            found.append((name, param, _constraint_value(name, param, body[name])))
    found += _structured_outputs(body)
    if plan is not None and plan.constrained:
        label = "tool_choice 'required'" if plan.choice == "required" else "a named tool_choice"
        found.append((label, "json_schema", json.dumps(tool_call_schema(plan))))
    if len(found) > 1:
        raise ApiError(
            400,
            "give at most one output constraint (response_format, regex, ebnf, json_schema, "
            f"choice, structural_tag, a forced tool call); got {', '.join(f[0] for f in found)}",
        )
    if plan is not None and plan.choice == "auto" and plan.tagged:
        return {"structural_tag": json.dumps(_auto_tool_format(plan, found[0] if found else None))}
    return {found[0][1]: found[0][2]} if found else {}


def _auto_tool_format(plan: ToolPlan, other: tuple[str, str, Any] | None) -> dict[str, Any]:
    """Auto mode's structural tag: free text with constrained calls; with a JSON-schema format as
    well, either a document in that format or text with at least one call."""
    calls = tool_call_tags(plan)
    if other is None:
        return {"type": "structural_tag", "format": calls}
    if other[1] != "json_schema":
        raise ApiError(
            400, f"tools with tool_choice 'auto' combine with a JSON-schema response_format only, not with {other[0]}"
        )
    doc = tag_json(json.loads(other[2]))
    return {
        "type": "structural_tag",
        "format": {"type": "or", "elements": [doc, tool_call_tags(plan, at_least_one=True)]},
    }


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        value = typed_field(body, name, is_int, "an int")
        if value is not None:
            if not 0 <= value <= MAX_INT:
                raise ApiError(400, f"{name} must be in [0, {MAX_INT}], got {value}")
            return value
    return None


def _sampling(body: dict[str, Any], chat: bool, plan: ToolPlan | None = None) -> dict[str, Any]:
    """The sampling params shared by all prompts (max_new_tokens is set per prompt later)."""
    sp = {
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "n": body.get("n"),
        "stop": body.get("stop"),
        "seed": body.get("seed"),
        "frequency_penalty": body.get("frequency_penalty"),
        "presence_penalty": body.get("presence_penalty"),
    }
    for name, target in EXTRA_PARAMS.items():
        if body.get(name) is not None:
            sp[target] = body[name]
    sp.update(_constraints(body, plan))
    return {k: v for k, v in sp.items() if v is not None}


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if chat:
        want = typed_field(body, "logprobs", is_bool, "a bool", False)
        k = typed_field(body, "top_logprobs", is_int, "an int", 0)
        if k and not want:
            raise ApiError(400, "top_logprobs needs logprobs: true")
    else:
        k = typed_field(body, "logprobs", is_int, "an int")
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
    raise ApiError(
        400,
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids (non-empty)",
    )


def parse_openai(state: ServerState, body: dict[str, Any], chat: bool) -> OpenAIRequest:
    """Validate and translate a completions (chat=False) or chat completions body."""
    state.check_model(body)
    _reject_unsupported(body)
    plan = None
    if chat:
        plan = parse_tools(body)
        if plan is not None:
            source = template_source(state.engine.tokenizer)
            plan.fmt = tool_call_format(state.engine.args.tool_call_parser, source)
        prompts: list[str | list[int]] = [
            render_chat(
                state.engine.tokenizer, body.get("messages"), plan.tools if plan else None, template_kwargs(body)
            )
        ]
    else:
        if (body.get("tools") and body.get("tool_choice") != "none") or body.get("tool_choice") not in (None, "none"):
            raise ApiError(400, "tools are supported on /v1/chat/completions only")
        prompts = _completion_prompts(body)
    base = _sampling(body, chat, plan)
    max_tokens = _max_tokens(body, chat)
    params = [{**base, "max_new_tokens": _default_max(state, p, max_tokens, chat)} for p in prompts]
    parser = state.engine.args.reasoning_parser
    if chat and parser and any(k in base for k in GRAMMAR_PARAMS) and not RAW_GRAMMAR_FIELDS & body.keys():
        tail = state.engine.tokenizer.decode(prompts[0][-16:], skip_special_tokens=False)
        params = [{**p, **reasoning_gate(parser, tail)} for p in params]
    n = typed_field(body, "n", is_int, "an int", 1)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}")
    stream = typed_field(body, "stream", is_bool, "a bool", False)
    opts = typed_field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = bool(stream and typed_field(opts, "include_usage", is_bool, "a bool", False))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    separate = body.get("separate_reasoning", True)
    if not is_bool(separate):
        raise ApiError(400, "separate_reasoning must be a boolean")
    reasoning = state.engine.args.reasoning_parser if chat and separate else None
    return OpenAIRequest(chat, prompts, params, n, _logprobs(body, chat), stream, include_usage, rid, plan, reasoning)


def _default_max(state: ServerState, prompt: str | list[int], max_tokens: int | None, chat: bool) -> int:
    if max_tokens is not None:
        return max_tokens
    if not chat or not state.context_len:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    # chat: up to the end of the context, as OpenAI does (an over-long prompt fails in the engine)
    return max(state.context_len - len(prompt), 1)


# --- non-streaming ----------------------------------------------------------------------------
def engine_prompts(req: OpenAIRequest) -> dict[str, Any]:
    key = "prompt" if isinstance(req.prompts[0], str) else "input_ids"
    return {key: list(req.prompts)}
