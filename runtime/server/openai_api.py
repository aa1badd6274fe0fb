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

Tool calling (chat): `tools` are rendered into the prompt by the chat template when it knows tools,
else by a Hermes-style system block (`<tools>` ... `<tool_call>{"name", "arguments"}</tool_call>`).
`tool_choice` "auto" (the default with tools) lets the model answer or call: its output is parsed
for `<tool_call>` blocks or a bare `{"name", "arguments"}` JSON, and where calls are `<tool_call>`
blocks (our Hermes block, or a template that writes them) a structural tag holds each call the
model opens to the offered tools' schemas (one call if `parallel_tool_calls` is false; with a
JSON-schema response_format, the answer is that document or text with a call); "required" constrains the output
to a call of one of the tools (an array of calls with `parallel_tool_calls: true`); a named
function constrains it to that function's arguments; "none" offers no tools. Calls come back as
`message.tool_calls` with finish_reason "tool_calls"; streamed, a call held by a grammar comes as
OpenAI sends it (id and name, then its arguments in pieces as they are written).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from starlette.responses import Response

from .api_schema import (MAX_TOP_LOGPROBS, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                         CompletionResponse, json_body, ref, responses)
from .http_server import (SSE_DONE, ApiError, EventStream, Hold, ServerState, abort_error, expand_rids, is_int,
                          json_response, read_json, sse)
from ..sampling_params import MAX_INT, MAX_N
from .metrics import StreamTimer

logger = logging.getLogger("plait.http")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for the legacy completions API
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# OpenAI-side name -> sampling parameter, for the extensions passed through.
EXTRA_PARAMS = {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                "min_tokens": "min_new_tokens", "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
                "no_stop_trim": "no_stop_trim", "skip_special_tokens": "skip_special_tokens",
                "spaces_between_special_tokens": "spaces_between_special_tokens",
                "json_max_number_digits": "json_max_number_digits", "json_max_string_length": "json_max_string_length"}
# Grammar constraints in the body (SGLang's names, `choice`, and vLLM's guided_* names) -> the
# sampling parameter; at most one per request, counting response_format and a forced tool call.
CONSTRAINT_FIELDS = {"regex": "regex", "ebnf": "ebnf", "json_schema": "json_schema", "choice": "choices",
                     "guided_regex": "regex", "guided_grammar": "ebnf", "guided_json": "json_schema",
                     "guided_choice": "choices", "structural_tag": "structural_tag"}
GRAMMAR_PARAMS = ("regex", "ebnf", "json_schema", "choices", "structural_tag")
# vLLM's `structured_outputs` object: its keys -> the sampling parameter (json_object: any object)
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choices", "grammar": "ebnf",
                      "json_object": "json_schema", "structural_tag": "structural_tag"}
# Its options that change nothing here (plait never falls back to unconstrained text)
STRUCTURED_OPTIONS = ("disable_fallback",)
# Constraint-like fields other servers take that plait does not enforce: a 400 naming them, never
# an answer that silently ignores them.
UNSUPPORTED_CONSTRAINTS = ("guided_whitespace_pattern", "whitespace_pattern")
TOOL_CHOICES = ("none", "auto", "required")
TOOL_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# The tools block for chat templates that do not render tools themselves (Qwen2.5's wording, so
# the call format is the common Hermes one that parse_tool_calls reads back).
TOOLS_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclasses.dataclass
class ToolPlan:
    """The tools of a chat request and what the model may do with them."""
    tools: list[dict[str, Any]]             # [{"type": "function", "function": {name, description?, parameters}}]
    choice: str                             # "none" | "auto" | "required" | "named"
    named: str | None = None                # the function of a named tool_choice
    parallel: bool = False                  # "required": an array of one or more calls
    parallel_tool_calls: bool | None = None # as the request gave it (None: OpenAI's default, true)
    tagged: bool = False                    # the template writes calls as <tool_call> blocks (Hermes)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"]["parameters"]
        raise KeyError(name)

    @property
    def constrained(self) -> bool:
        """The output is forced to be a call (a grammar), not parsed out of free text."""
        return self.choice in ("required", "named")


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
    tools: ToolPlan | None = None           # chat with tools the model may call (not "none")

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
    if kind == "json_object":   # llama.cpp's server (and instructor's JSON_SCHEMA mode) may add a schema
        schema = fmt.get("schema")
        if schema is None:
            return "json_schema", json.dumps({"type": "object"})
        _check_schema(schema, "response_format.schema")
        return "json_schema", json.dumps(schema)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ApiError(400, "response_format.json_schema must be an object with name and schema")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object")
        _check_schema(schema, "response_format.json_schema.schema")
        return "json_schema", json.dumps(schema)
    raise ApiError(400, "response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag'"
                   + (f", got {kind!r} (not supported)" if isinstance(kind, str) else ""))


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
    if not (isinstance(structures, list) and structures and isinstance(triggers, list) and triggers
            and all(isinstance(t, str) and t for t in triggers)):
        raise ApiError(400, f"{where} must have a 'format', or 'structures' and 'triggers'")
    tags = []
    for i, st in enumerate(structures):
        if not (isinstance(st, dict) and isinstance(st.get("begin"), str) and isinstance(st.get("end"), str)):
            raise ApiError(400, f"{where}.structures[{i}] must have begin, schema and end")
        schema = st.get("schema", {})
        _check_schema(schema, f"{where}.structures[{i}].schema")
        tags.append({"type": "tag", "begin": st["begin"], "end": st["end"],
                     "content": {"type": "json_schema", "json_schema": schema}})
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}})


def tool_call_tags(plan: ToolPlan, at_least_one: bool = False) -> dict[str, Any]:
    """The triggered-tags format of auto mode: free text, but once the model writes `<tool_call>`
    the call's JSON is held to one of the tools' schemas until `</tool_call>`; one call only when
    `parallel_tool_calls` is false."""
    tags = [{"type": "tag", "begin": f'{TOOL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": plan.parameters(name)},
             "end": f"}}\n{TOOL_CLOSE}"} for name in plan.names]
    return {"type": "triggered_tags", "triggers": [TOOL_OPEN], "tags": tags, "at_least_one": at_least_one,
            "stop_after_first": plan.parallel_tool_calls is False}


def _check_schema(schema: Any, where: str) -> None:
    """400 for a JSON schema that is not even well-formed (checked with jsonschema's metaschema
    where that package is installed; the grammar compiler reports the rest)."""
    if not isinstance(schema, (dict, bool)):
        raise ApiError(400, f"{where} must be a JSON schema object, got {type(schema).__name__}")
    try:
        from jsonschema import exceptions, validators
    except ImportError:   # not a runtime dependency
        return
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as e:
        raise ApiError(400, f"{where} is not a valid JSON schema: {e.message}") from None


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
    _check_schema(schema, name)
    return json.dumps(schema)


def _structured_outputs(body: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """vLLM's `structured_outputs` object -> (label, sampling parameter, value) per constraint in
    it; 400 for a key plait does not enforce."""
    so = body.get("structured_outputs")
    if so is None:
        return []
    if not isinstance(so, dict):
        raise ApiError(400, "structured_outputs must be an object")
    unknown = sorted(k for k, v in so.items()
                     if k not in STRUCTURED_OUTPUTS and k not in STRUCTURED_OPTIONS and v not in (None, False))
    if unknown:
        raise ApiError(400, f"structured_outputs.{unknown[0]} is not supported (supported: "
                       f"{', '.join(STRUCTURED_OUTPUTS)})")
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
            raise ApiError(400, f"{name} is not supported: plait enforces response_format, structured_outputs "
                           "(json, regex, choice, grammar, json_object, structural_tag), regex, ebnf, json_schema, "
                           "structural_tag and choice")
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
        raise ApiError(400, "give at most one output constraint (response_format, regex, ebnf, json_schema, "
                       f"choice, structural_tag, a forced tool call); got {', '.join(f[0] for f in found)}")
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
        raise ApiError(400, f"tools with tool_choice 'auto' combine with a JSON-schema response_format only, "
                       f"not with {other[0]}")
    doc = {"type": "json_schema", "json_schema": json.loads(other[2])}
    return {"type": "structural_tag",
            "format": {"type": "or", "elements": [doc, tool_call_tags(plan, at_least_one=True)]}}


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        value = _field(body, name, is_int, "an int")
        if value is not None:
            if not 0 <= value <= MAX_INT:
                raise ApiError(400, f"{name} must be in [0, {MAX_INT}], got {value}")
            return value
    return None


def _sampling(body: dict[str, Any], chat: bool, plan: ToolPlan | None = None) -> dict[str, Any]:
    """The sampling params shared by all prompts (max_new_tokens is set per prompt later)."""
    sp = {"temperature": body.get("temperature"), "top_p": body.get("top_p"), "n": body.get("n"),
          "stop": body.get("stop"), "seed": body.get("seed"),
          "frequency_penalty": body.get("frequency_penalty"), "presence_penalty": body.get("presence_penalty")}
    for name, target in EXTRA_PARAMS.items():
        if body.get(name) is not None:
            sp[target] = body[name]
    sp.update(_constraints(body, plan))
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


# --- tools ------------------------------------------------------------------------------------
def parse_tools(body: dict[str, Any]) -> ToolPlan | None:
    """`tools` / `tool_choice` / `parallel_tool_calls` of a chat body (None: no tools offered);
    400 for malformed tools or a tool_choice naming an unknown function."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is not None and not isinstance(raw, list):
        raise ApiError(400, "tools must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    tools = [_parse_tool(t, i) for i, t in enumerate(raw or [])]
    names = [t["function"]["name"] for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ApiError(400, f"tools: function names must be unique, repeated: {', '.join(dup)}")
    named = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(named, str):
            raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if named not in names:
            raise ApiError(400, f"tool_choice names the function {named!r}, which is not in tools"
                           + (f" ({', '.join(names)})" if names else ""))
        choice = "named"
    elif choice not in TOOL_CHOICES:
        raise ApiError(400, f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}")
    if choice == "required" and not tools:
        raise ApiError(400, "tool_choice 'required' needs tools")
    parallel = _field(body, "parallel_tool_calls", _is_bool, "a bool", None)
    if choice == "none" or not tools:
        return None
    return ToolPlan(tools, choice, named, parallel is True, parallel)


def _parse_tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ApiError(400, f"{where} must be an object with type 'function'")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ApiError(400, f"{where}.function must be an object with a name")
    name = fn.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 64 or not set(name) <= TOOL_NAME_CHARS:
        raise ApiError(400, f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -, got {name!r}")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ApiError(400, f"{where}.function.description must be a string")
    params = fn.get("parameters")
    if params is None:
        params = dict(EMPTY_PARAMETERS)
    if not isinstance(params, dict):
        raise ApiError(400, f"{where}.function.parameters must be a JSON schema object")
    _check_schema(params, f"{where}.function.parameters")
    out = {"name": name, **({"description": desc} if desc else {}), "parameters": params}
    return {"type": "function", "function": out}


def tool_call_schema(plan: ToolPlan) -> dict[str, Any]:
    """The JSON schema a forced call is generated under: a named function's arguments; for
    "required" a `{"name", "arguments"}` object of any of the tools (an array of them when
    parallel calls are on). Each tool's `$defs` move to the root (renamed per tool) and its local
    `$ref`s are rewritten, so references keep pointing where they did."""
    if plan.choice == "named":
        return plan.parameters(plan.named)
    root = "#/items/anyOf" if plan.parallel else "#/anyOf"
    defs: dict[str, Any] = {}
    alts = []
    for i, name in enumerate(plan.names):
        args = _relocate(plan.parameters(name), f"{root}/{i}/properties/arguments", f"{name}__", defs)
        alts.append({"type": "object", "properties": {"name": {"const": name}, "arguments": args},
                     "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"anyOf": alts}
    if plan.parallel:
        schema = {"type": "array", "items": schema, "minItems": 1}
    if defs:
        schema["$defs"] = defs
    return schema


def _relocate(schema: dict[str, Any], base: str, prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    def ref(r: str) -> str:
        for head in ("#/$defs/", "#/definitions/"):
            if r.startswith(head):
                return "#/$defs/" + prefix + r[len(head):]
        return base + r[1:] if r.startswith("#") else r

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: (ref(x) if k == "$ref" and isinstance(x, str) else walk(x)) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    out = {k: v for k, v in schema.items() if k not in ("$defs", "definitions", "$schema", "$id")}
    for key in ("$defs", "definitions"):
        for name, sub in (schema.get(key) or {}).items():
            defs[prefix + name] = walk(sub)
    return walk(out)


def _template_source(tokenizer: Any) -> str:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):   # named templates ("default", "tool_use", ...)
        return "\n".join(t for t in tpl.values() if isinstance(t, str))
    return tpl if isinstance(tpl, str) else ""


def _history_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` -> [{"id", "name", "arguments" (parsed when JSON)}]."""
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{i}].tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or c.get("type", "function") != "function":
            raise ApiError(400, f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"id\", "
                           "\"function\": {\"name\", \"arguments\"}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass   # kept as the string the client sent
        elif not isinstance(args, dict):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON string")
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}].id must be a string")
        out.append({"id": cid, "name": fn["name"], "arguments": args})
    return out


def _call_text(name: str, args: Any) -> str:
    return f"{TOOL_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{TOOL_CLOSE}"


def render_chat(tokenizer: Any, messages: Any, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Messages -> prompt token ids through the tokenizer's chat template, with the generation
    prompt appended. The template supplies the special tokens, so none are added again.

    `tools`, assistant `tool_calls` and `tool` results go through the template when it knows them
    (its source mentions tools / tool_calls); otherwise tools become a Hermes-style system block,
    calls `<tool_call>` text in the assistant's content and results `<tool_response>` user turns."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    source = _template_source(tokenizer)
    native_tools, native_calls = "tools" in source, "tool_calls" in source
    conv: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}   # tool_call_id -> function name, for the tool results
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = _content_text(m.get("content"), i)
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ApiError(400, f"messages[{i}].{key} must be a string")
        if m.get("tool_calls") is not None and role != "assistant":
            raise ApiError(400, f"messages[{i}]: only assistant messages carry tool_calls")
        calls = _history_calls(m["tool_calls"], i) if role == "assistant" and m.get("tool_calls") is not None else []
        if calls:
            call_names.update({c["id"]: c["name"] for c in calls if c["id"]})
            if native_calls:
                conv.append({"role": "assistant", "content": content, "tool_calls": [
                    {**({"id": c["id"]} if c["id"] else {}), "type": "function",
                     "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]})
            else:
                text = "\n".join([content] * bool(content) + [_call_text(c["name"], c["arguments"]) for c in calls])
                conv.append({"role": "assistant", "content": text})
        elif role == "tool":
            tcid = m.get("tool_call_id")
            if tcid is not None and not isinstance(tcid, str):
                raise ApiError(400, f"messages[{i}].tool_call_id must be a string")
            name = m.get("name") if isinstance(m.get("name"), str) else call_names.get(tcid or "")
            if native_calls:
                conv.append({"role": "tool", "content": content, **({"tool_call_id": tcid} if tcid else {}),
                             **({"name": name} if name else {})})
            else:   # consecutive results share one user turn, as Qwen's template does
                block = f"<tool_response>\n{content}\n</tool_response>"
                if conv and conv[-1].get("_results"):
                    conv[-1]["content"] += "\n" + block
                else:
                    conv.append({"role": "user", "content": block, "_results": True})
        else:
            conv.append({"role": "system" if role == "developer" else role, "content": content})
    for c in conv:
        c.pop("_results", None)
    kwargs: dict[str, Any] = {}
    if tools:
        if native_tools:
            kwargs["tools"] = tools
        else:
            block = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
            if conv[0]["role"] == "system":
                conv[0] = {**conv[0], "content": (conv[0]["content"] + "\n\n" + block).lstrip()}
            else:
                conv.insert(0, {"role": "system", "content": block})
    try:
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as e:   # jinja errors (e.g. roles out of order) are the caller's to fix
        raise ApiError(400, f"messages could not be rendered with the chat template: {e}") from None
    return tokenizer(text, add_special_tokens=False).input_ids


# --- reading tool calls back ------------------------------------------------------------------
def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_from(obj: Any, names: list[str]) -> dict[str, str] | None:
    """{"name", "arguments" (JSON text)} from a parsed call object, or None if it is not a call of
    one of `names` ("parameters" is accepted for "arguments", as Llama 3 writes it)."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _calls_in_json(text: str, names: list[str]) -> list[dict[str, str]] | None:
    """The call(s) in a JSON value at the start of `text` (trailing text is ignored); None unless
    every element is a call of a known tool."""
    try:
        value, _ = json.JSONDecoder().raw_decode(text.strip())
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call_from(v, names) for v in items]
    return calls if calls and all(calls) else None   # type: ignore[return-value]


def parse_tool_calls(text: str, names: list[str]) -> tuple[str | None, list[dict[str, str]]]:
    """A free-text answer -> (content, calls): `<tool_call>{...}</tool_call>` blocks (the content
    is the text before the first), or the whole text being a call object / a list of them. No
    calls found (or a malformed one): (text, [])."""
    start = text.find(TOOL_OPEN)
    if start >= 0:
        calls = []
        for block in text[start:].split(TOOL_OPEN)[1:]:
            found = _calls_in_json(block.split(TOOL_CLOSE, 1)[0], names)
            if found is None:
                return text, []
            calls += found
        return (text[:start].strip() or None), calls
    if text.lstrip().startswith(("{", "[")):
        found = _calls_in_json(text, names)
        if found:
            return None, found
    return text, []


def forced_calls(plan: ToolPlan, text: str) -> list[dict[str, str]] | None:
    """The call(s) of a grammar-constrained answer; None when it is not complete JSON (cut by
    max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if plan.choice == "named":
        if not isinstance(value, dict):
            return None
        return [{"name": plan.named, "arguments": text.strip()}]   # as streamed
    return _calls_in_json(text, plan.names)


def tool_call_objects(calls: list[dict[str, str]]) -> list[dict[str, Any]]:
    """OpenAI `message.tool_calls`."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]


_JSON = json.JSONDecoder()
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def call_pieces(text: str, start: int = 0) -> list[tuple[str, int, int | None]]:
    """The calls `{"name": ..., "arguments": ...}` in `text` from `start`, as far as written:
    (name, where the arguments start, where they end or None while they are being written)."""
    out: list[tuple[str, int, int | None]] = []
    pos = start
    while (m := _CALL_HEAD.search(text, pos)) is not None:
        name = json.loads(f'"{m.group(1)}"')
        args_at = m.end()
        try:
            end = _JSON.raw_decode(text, args_at)[1]
        except ValueError:   # still being written
            end = None
        out.append((name, args_at, end))
        if end is None:
            break
        pos = end
    return out


class ToolStream:
    """Streaming of one choice's tool calls, as OpenAI sends them: each call's id and name once
    written, then its arguments as they come. Where a grammar makes the calls well-formed (a
    named function, "required", auto mode's tagged calls) they stream as the model writes them;
    otherwise (auto mode parsing free text) content streams as long as the text cannot be a call
    (a possible start of `<tool_call>` and a leading JSON value are held back) and the calls come
    when the choice ends."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.emitted = 0            # characters of the text already sent as content (or named arguments)
        self.calls_at: int | None = None   # where call syntax starts in the text (held from there)
        self.call_id = new_call_id()
        self.sent: list[int] = []   # per call streamed so far: characters of its arguments sent
        self.live = plan.choice == "required" or (plan.choice == "auto" and plan.tagged)

    def update(self, text: str) -> list[dict[str, Any]]:
        """Deltas for the cumulative text so far (the choice is not finished)."""
        if self.plan.choice == "named":
            return self._named(text)
        if self.plan.choice == "required":
            return self._stream_calls(text, 0)
        if self.calls_at is not None:
            return self._stream_calls(text, self.calls_at) if self.live else []
        found = text.find(TOOL_OPEN, self.emitted)
        if found >= 0:
            self.calls_at = found
            out = self._content(text, found)
            return out + (self._stream_calls(text, found) if self.live else [])
        stripped = text.lstrip()
        if self.emitted == 0 and (not stripped or stripped.startswith(("{", "["))):
            if stripped:
                self.calls_at = len(text) - len(stripped)
            return []
        hold = next((k for k in range(len(TOOL_OPEN) - 1, 0, -1) if text.endswith(TOOL_OPEN[:k])), 0)
        return self._content(text, len(text) - hold)

    def finish(self, text: str, reason: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas and the finish reason (made "tool_calls" when there are calls)."""
        if self.plan.choice == "named":
            deltas = self._named(text)
            return deltas, ("tool_calls" if reason == "stop" else reason)
        if self.plan.choice == "required":
            deltas = self._stream_calls(text, 0)
            complete = reason == "stop" and forced_calls(self.plan, text) is not None
            return deltas, ("tool_calls" if complete else reason)
        if self.calls_at is not None:
            content, calls = parse_tool_calls(text[self.calls_at:], self.plan.names)
            if self.live and self.sent:
                return self._stream_calls(text, self.calls_at), ("tool_calls" if calls else reason)
            if calls:
                return self._calls(calls), "tool_calls"
        return self._content(text, len(text)), reason

    def _stream_calls(self, text: str, start: int) -> list[dict[str, Any]]:
        """Deltas for the calls written from `start`: a new call's id and name, then the part of
        each call's arguments not sent yet."""
        out = []
        for k, (name, at, end) in enumerate(call_pieces(text, start)):
            if k == len(self.sent):
                self.sent.append(0)
                out.append({"tool_calls": [{"index": k, "id": new_call_id(), "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            stop = end if end is not None else len(text)
            piece = text[at + self.sent[k]:stop] if stop > at + self.sent[k] else ""
            if piece:
                self.sent[k] += len(piece)
                out.append({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
        return out

    def _content(self, text: str, upto: int) -> list[dict[str, Any]]:
        piece = text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return [{"content": piece}] if piece else []

    def _named(self, text: str) -> list[dict[str, Any]]:
        piece = text[self.emitted:]
        if not piece:
            return []
        call: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
        if self.emitted == 0:
            call = {"index": 0, "id": self.call_id, "type": "function",
                    "function": {"name": self.plan.named, "arguments": piece}}
        self.emitted = len(text)
        return [{"tool_calls": [call]}]

    @staticmethod
    def _calls(calls: list[dict[str, str]]) -> list[dict[str, Any]]:
        return [{"tool_calls": [{"index": k, **obj}]} for k, obj in enumerate(tool_call_objects(calls))]


def parse_openai(state: ServerState, body: dict[str, Any], chat: bool) -> OpenAIRequest:
    """Validate and translate a completions (chat=False) or chat completions body."""
    state.check_model(body)
    _reject_unsupported(body)
    plan = None
    if chat:
        plan = parse_tools(body)
        if plan is not None:
            source = _template_source(state.engine.tokenizer)
            plan.tagged = "tools" not in source or TOOL_OPEN in source   # our Hermes block, or the template's
        prompts: list[str | list[int]] = [render_chat(state.engine.tokenizer, body.get("messages"),
                                                      plan.tools if plan else None)]
    else:
        if (body.get("tools") and body.get("tool_choice") != "none") or body.get("tool_choice") not in (None, "none"):
            raise ApiError(400, "tools are supported on /v1/chat/completions only")
        prompts = _completion_prompts(body)
    base = _sampling(body, chat, plan)
    max_tokens = _max_tokens(body, chat)
    params = [{**base, "max_new_tokens": _default_max(state, p, max_tokens, chat)} for p in prompts]
    n = _field(body, "n", is_int, "an int", 1)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}")
    stream = _field(body, "stream", _is_bool, "a bool", False)
    opts = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = bool(stream and _field(opts, "include_usage", _is_bool, "a bool", False))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    return OpenAIRequest(chat, prompts, params, n, _logprobs(body, chat), stream, include_usage, rid, plan)


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


def _message(req: OpenAIRequest, text: str, reason: str) -> tuple[dict[str, Any], str]:
    """The assistant message of a finished chat choice and its finish reason (tool calls read
    out of the text when the request has tools)."""
    plan = req.tools
    content: str | None = text
    calls: list[dict[str, str]] | None = None
    if plan is not None and plan.constrained:
        calls = forced_calls(plan, text) if reason == "stop" else None
        if calls:
            content = None
    elif plan is not None:
        content, calls = parse_tool_calls(text, plan.names)
    if not calls:
        return {"role": "assistant", "content": text}, reason
    return {"role": "assistant", "content": content, "tool_calls": tool_call_objects(calls)}, "tool_calls"


def _choice(req: OpenAIRequest, index: int, result: dict[str, Any]) -> dict[str, Any]:
    reason = finish_reason(result)
    entries = _token_logprobs(result, 0, visible_tokens(result)) if req.logprobs is not None else None
    if req.chat:
        message, reason = _message(req, result["text"], reason)
        return {"index": index, "message": message,
                "logprobs": chat_logprobs(entries) if entries is not None else None, "finish_reason": reason}
    return {"index": index, "text": result["text"], "finish_reason": reason,
            "logprobs": completion_logprobs(entries, 0, req.logprobs) if entries is not None else None}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI `usage`; `prompt_tokens_details.cached_tokens`: prompt tokens read from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_prompt_tokens(results: list[dict[str, Any]]) -> int:
    """Cached tokens of one prompt's n samples: the fewest any of them read from the cache, i.e. what
    was cached before this request (the samples after the first read the prompt it computed)."""
    return min(r["meta_info"]["cached_tokens"] for r in results)


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
    cached = sum(cached_prompt_tokens(results[j * req.n:(j + 1) * req.n]) for j in range(len(req.prompts)))
    return json_response({**_envelope(req, state, int(time.time()), False), "choices": choices,
                          "usage": usage(prompt_tokens, completion_tokens, cached)})


# --- streaming --------------------------------------------------------------------------------
class StreamShaper:
    """Cumulative engine results of each choice -> OpenAI chunks (deltas)."""

    def __init__(self, req: OpenAIRequest, state: ServerState):
        self.req = req
        self.env = _envelope(req, state, int(time.time()), True)
        self.text_len: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.prompt_tokens: dict[int, int] = {}     # per prompt
        self.cached_tokens: dict[int, int] = {}     # per prompt (see cached_prompt_tokens)
        self.completion_tokens = 0
        self.tool_streams: dict[int, ToolStream] = {}

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
        return {**self.env, "choices": [], "usage": usage(sum(self.prompt_tokens.values()), self.completion_tokens,
                                                          cached)}


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


def _constrained(req: OpenAIRequest) -> bool:
    return any(p.get(k) is not None for p in req.params for k in GRAMMAR_PARAMS)


async def open_engine_stream(state: ServerState, request: Request, req: OpenAIRequest, rids: list[str]
                             ) -> tuple[Hold, AsyncIterator[tuple[int, dict]], tuple[int, dict] | None]:
    """Admit a streamed request and open one engine stream per choice: (its hold, the merged
    (choice, result) stream, the first result when the request is constrained, else None)."""
    hold = state.admit(rids, {req.rid: rids})   # the response id aborts every choice
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


async def _stream(state: ServerState, request: Request, req: OpenAIRequest) -> Response:
    rids = [f"{req.rid}-{k}" for k in range(len(req.prompts) * req.n)]
    hold, merged, first = await open_engine_stream(state, request, req, rids)
    return EventStream(_events(state, req, hold, rids, merged, first), hold)


async def _with_first(first: tuple[int, dict] | None,
                      rest: AsyncIterator[tuple[int, dict]]) -> AsyncIterator[tuple[int, dict]]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


async def _events(state: ServerState, req: OpenAIRequest, hold: Hold, rids: list[str],
                  merged: AsyncIterator[tuple[int, dict]], first: tuple[int, dict] | None) -> AsyncIterator[str]:
    shaper = StreamShaper(req, state)
    timers = [StreamTimer(state.metrics, hold.start) for _ in rids]
    items = _with_first(first, merged)
    try:
        while True:
            try:
                idx, result = await state.next_result(hold, items)   # 504 past --request-timeout
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
        hold.close()   # abort the other choices before the client hears of it
        yield sse(e.body())
    except Exception:
        logger.exception("stream %s failed", req.rid)
        hold.close()
        yield sse(ApiError(500, "internal error while streaming").body())
    finally:
        await items.aclose()
        await merged.aclose()
    yield SSE_DONE


# --- routes -----------------------------------------------------------------------------------
async def handle_openai(state: ServerState, request: Request, chat: bool) -> Response:
    """POST /v1/completions (chat=False) and /v1/chat/completions (chat=True)."""
    body = await read_json(request)
    state.log_request(request.url.path, body)
    req = parse_openai(state, body, chat)
    if req.stream:
        return await _stream(state, request, req)
    return await _complete(state, request, req)


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    """The OpenAI-compatible routes."""

    @app.get("/v1/models", responses=responses({"type": "object"}))
    async def models() -> Response:
        card = {"id": state.served_model_name, "object": "model", "created": 0, "owned_by": "plait",
                "root": state.model_path, "max_model_len": state.context_len}
        return json_response({"object": "list", "data": [card]})

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest),
              responses=responses(ref(CompletionResponse), stream=True))
    async def completions(request: Request) -> Response:
        return await handle_openai(state, request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest),
              responses=responses(ref(ChatCompletionResponse), stream=True))
    async def chat_completions(request: Request) -> Response:
        return await handle_openai(state, request, chat=True)
