"""Tool calling (chat): `tools` are rendered into the prompt by the chat template when it knows tools,
else by a Hermes-style system block (`<tools>` ... `<tool_call>{"name", "arguments"}</tool_call>`).
`tool_choice` "auto" (the default with tools) lets the model answer or call: its output is parsed
for calls in the model family's format (`tool_parsers.py`: Hermes, Llama 3, Mistral, or plain
JSON), and a structural tag holds each call the model opens to the offered tools' schemas (one
call if `parallel_tool_calls` is false; with a JSON-schema response_format, the answer is that
document or text with a call); "required" constrains the output to a call of one of the tools (an
array of calls with `parallel_tool_calls: true`); a named function constrains it to that
function's arguments; "none" offers no tools. Calls come back as `message.tool_calls` with
finish_reason "tool_calls"; streamed, a call held by a grammar comes as OpenAI sends it (id and
name, then its arguments in pieces as they are written).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from .http_common import ApiError
from .openai_fields import CHAT_ROLES, content_text, is_bool, require_schema, typed_field
from .tool_parsers import HERMES, ToolCallFormat

TOOL_CHOICES = ("none", "auto", "required")
TOOL_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
TOOL_OPEN, TOOL_CLOSE = HERMES.open, HERMES.close
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# A call's JSON (xgrammar's structural tag) allows any whitespace between tokens: a small model can
# write newlines until max_tokens. A run this long still lets a model indent a nested call.
MAX_WHITESPACE = 16
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

    tools: list[dict[str, Any]]  # [{"type": "function", "function": {name, description?, parameters}}]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function of a named tool_choice
    parallel: bool = False  # "required": an array of one or more calls
    parallel_tool_calls: bool | None = None  # as the request gave it (None: OpenAI's default, true)
    fmt: ToolCallFormat = HERMES  # how the model writes calls (--tool-call-parser, or the template's)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"]["parameters"]
        raise KeyError(name)

    @property
    def tagged(self) -> bool:
        """Auto mode holds each call the model opens to the tools' schemas (a structural tag)."""
        return self.fmt.constrained

    @property
    def constrained(self) -> bool:
        """The output is forced to be a call (a grammar), not parsed out of free text."""
        return self.choice in ("required", "named")


def tag_json(schema: dict[str, Any]) -> dict[str, Any]:
    """A structural tag's JSON-schema content, its whitespace runs bounded (MAX_WHITESPACE)."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def tool_call_tags(plan: ToolPlan, at_least_one: bool = False) -> dict[str, Any]:
    """The triggered-tags format of auto mode: free text, but once the model starts a call (in its
    format: `<tool_call>`, `[TOOL_CALLS]`, Llama 3's `{"name": `) the call's JSON is held to one of
    the tools' schemas until its end; one call only when `parallel_tool_calls` is false."""
    fmt = plan.fmt
    tags = [
        {
            "type": "tag",
            "begin": fmt.begin(name),
            "content": tag_json(plan.parameters(name)),
            "end": fmt.end,
        }
        for name in plan.names
    ]
    return {
        "type": "triggered_tags",
        "triggers": [fmt.trigger],
        "tags": tags,
        "at_least_one": at_least_one,
        "stop_after_first": plan.parallel_tool_calls is False,
    }


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
            raise ApiError(
                400,
                "tool_choice must be 'none', 'auto', 'required' or "
                "{\"type\": \"function\", \"function\": {\"name\": ...}}",
            )
        if named not in names:
            raise ApiError(
                400,
                f"tool_choice names the function {named!r}, which is not in tools"
                + (f" ({', '.join(names)})" if names else ""),
            )
        choice = "named"
    elif choice not in TOOL_CHOICES:
        raise ApiError(400, f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}")
    if choice == "required" and not tools:
        raise ApiError(400, "tool_choice 'required' needs tools")
    parallel = typed_field(body, "parallel_tool_calls", is_bool, "a bool", None)
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
    require_schema(params, f"{where}.function.parameters")
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
        alts.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": args},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
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
                return "#/$defs/" + prefix + r[len(head) :]
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


def template_source(tokenizer: Any) -> str:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):  # named templates ("default", "tool_use", ...)
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
            raise ApiError(
                400,
                f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"id\", "
                "\"function\": {\"name\", \"arguments\"}}",
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # kept as the string the client sent
        elif not isinstance(args, dict):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON string")
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}].id must be a string")
        out.append({"id": cid, "name": fn["name"], "arguments": args})
    return out


def _call_text(name: str, args: Any) -> str:
    return f"{TOOL_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{TOOL_CLOSE}"


# Variables a request may not set: render_chat passes these itself.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "add_generation_prompt",
        "tokenize",
        "return_dict",
        "continue_final_message",
        "chat_template",
    }
)


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The request's `chat_template_kwargs` (vLLM's and SGLang's field), checked."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict) or not all(isinstance(k, str) for k in kw):
        raise ApiError(400, "chat_template_kwargs must be an object of template variables")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(kw))
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(reserved)}")
    return kw


def render_chat(
    tokenizer: Any,
    messages: Any,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Messages -> prompt token ids through the tokenizer's chat template, with the generation
    prompt appended. The template supplies the special tokens, so none are added again.
    `template_kwargs` (a request's `chat_template_kwargs`, e.g. `enable_thinking`) are the
    template's own variables.

    `tools`, assistant `tool_calls` and `tool` results go through the template when it knows them
    (its source mentions tools / tool_calls); otherwise tools become a Hermes-style system block,
    calls `<tool_call>` text in the assistant's content and results `<tool_response>` user turns."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    source = template_source(tokenizer)
    native_tools, native_calls = "tools" in source, "tool_calls" in source
    conv: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, for the tool results
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = content_text(m.get("content"), i)
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ApiError(400, f"messages[{i}].{key} must be a string")
        if m.get("tool_calls") is not None and role != "assistant":
            raise ApiError(400, f"messages[{i}]: only assistant messages carry tool_calls")
        calls = _history_calls(m["tool_calls"], i) if role == "assistant" and m.get("tool_calls") is not None else []
        if calls:
            call_names.update({c["id"]: c["name"] for c in calls if c["id"]})
            if native_calls:
                conv.append(
                    {
                        "role": "assistant",
                        "content": content,
                        "tool_calls": [
                            {
                                **({"id": c["id"]} if c["id"] else {}),
                                "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]},
                            }
                            for c in calls
                        ],
                    }
                )
            else:
                text = "\n".join([content] * bool(content) + [_call_text(c["name"], c["arguments"]) for c in calls])
                conv.append({"role": "assistant", "content": text})
        elif role == "tool":
            tcid = m.get("tool_call_id")
            if tcid is not None and not isinstance(tcid, str):
                raise ApiError(400, f"messages[{i}].tool_call_id must be a string")
            name = m.get("name") if isinstance(m.get("name"), str) else call_names.get(tcid or "")
            if native_calls:
                conv.append(
                    {
                        "role": "tool",
                        "content": content,
                        **({"tool_call_id": tcid} if tcid else {}),
                        **({"name": name} if name else {}),
                    }
                )
            else:  # consecutive results share one user turn, as Qwen's template does
                block = f"<tool_response>\n{content}\n</tool_response>"
                if conv and conv[-1].get("_results"):
                    conv[-1]["content"] += "\n" + block
                else:
                    conv.append({"role": "user", "content": block, "_results": True})
        else:
            conv.append({"role": "system" if role == "developer" else role, "content": content})
    for c in conv:
        c.pop("_results", None)
    kwargs: dict[str, Any] = dict(template_kwargs or {})
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
    except Exception as e:  # jinja errors (e.g. roles out of order) are the caller's to fix
        raise ApiError(400, f"messages could not be rendered with the chat template: {e}") from None
    return tokenizer(text, add_special_tokens=False).input_ids
