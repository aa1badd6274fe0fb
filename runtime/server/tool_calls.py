"""Reading tool calls back out of generated text: whole (`parse_tool_calls`, `forced_calls`) or
as it streams (`ToolStream`, which sends a call held by a grammar as OpenAI does).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from .openai_tools import ToolPlan
from .tool_parsers import HERMES, PYTHON_TAG, ToolCallFormat

_JSON = json.JSONDecoder()


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
    """The call(s) in the JSON value(s) at the start of `text`: one value, a list of calls, or
    values separated by `;` (as Llama 3 writes several); trailing text is ignored. None unless every
    element is a call of a known tool."""
    values: list[Any] = []
    pos = len(text) - len(text.lstrip())
    while True:
        try:
            value, pos = _JSON.raw_decode(text, pos)
        except ValueError:  # malformed, or cut off by max_tokens
            return None
        values += value if isinstance(value, list) else [value]
        rest = text[pos:].lstrip()
        if not rest.startswith(";") or not rest[1:].strip():
            break
        rest = rest[1:].lstrip()
        pos = len(text) - len(rest)
    calls = [_call_from(v, names) for v in values]
    return calls if calls and all(calls) else None  # type: ignore[return-value]


def parse_tool_calls(
    text: str, names: list[str], fmt: ToolCallFormat = HERMES
) -> tuple[str | None, list[dict[str, str]]]:
    """A free-text answer -> (content, calls): the calls after the format's opening text (Hermes'
    `<tool_call>` blocks, Mistral's `[TOOL_CALLS]` array; the content is the text before the first),
    or the whole text being call JSON (Llama 3's way, after `<|python_tag|>` at times). No calls
    found (or a malformed one): (text, [])."""
    start = text.find(fmt.open) if fmt.open else -1
    if start >= 0:
        calls = []
        for block in text[start:].split(fmt.open)[1:]:
            found = _calls_in_json(block.split(fmt.close, 1)[0] if fmt.close else block, names)
            if found is None:
                return text, []
            calls += found
        return (text[:start].strip() or None), calls
    body = text.lstrip()
    body = body[len(PYTHON_TAG) :] if body.startswith(PYTHON_TAG) else body
    if body.lstrip().startswith(("{", "[")):
        found = _calls_in_json(body, names)
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
        return [{"name": plan.named, "arguments": text.strip()}]  # as streamed
    return _calls_in_json(text, plan.names)


def tool_call_objects(calls: list[dict[str, str]]) -> list[dict[str, Any]]:
    """OpenAI `message.tool_calls`."""
    return [
        {"id": new_call_id(), "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls
    ]


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
        except ValueError:  # still being written
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
    (a possible start of the format's opening text and a leading JSON value are held back) and the calls come
    when the choice ends."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.emitted = 0  # characters of the text already sent as content (or named arguments)
        self.calls_at: int | None = None  # where call syntax starts in the text (held from there)
        self.call_id = new_call_id()
        self.sent: list[int] = []  # per call streamed so far: characters of its arguments sent
        self.live = plan.choice == "required" or (plan.choice == "auto" and plan.tagged)

    def update(self, text: str) -> list[dict[str, Any]]:
        """Deltas for the cumulative text so far (the choice is not finished)."""
        if self.plan.choice == "named":
            return self._named(text)
        if self.plan.choice == "required":
            return self._stream_calls(text, 0)
        if self.calls_at is not None:
            return self._stream_calls(text, self.calls_at) if self.live else []
        opener = self.plan.fmt.open
        found = text.find(opener, self.emitted) if opener else -1
        if found >= 0:
            self.calls_at = found
            out = self._content(text, found)
            return out + (self._stream_calls(text, found) if self.live else [])
        stripped = text.lstrip()
        if self.emitted == 0 and (not stripped or stripped.startswith(("{", "[", PYTHON_TAG))):
            if stripped:
                self.calls_at = len(text) - len(stripped)
            return []
        hold = next((k for k in range(len(opener or "") - 1, 0, -1) if text.endswith(opener[:k])), 0)
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
            content, calls = parse_tool_calls(text[self.calls_at :], self.plan.names, self.plan.fmt)
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
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": k,
                                "id": new_call_id(),
                                "type": "function",
                                "function": {"name": name, "arguments": ""},
                            }
                        ]
                    }
                )
            stop = end if end is not None else len(text)
            piece = text[at + self.sent[k] : stop] if stop > at + self.sent[k] else ""
            if piece:
                self.sent[k] += len(piece)
                out.append({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
        return out

    def _content(self, text: str, upto: int) -> list[dict[str, Any]]:
        piece = text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return [{"content": piece}] if piece else []

    def _named(self, text: str) -> list[dict[str, Any]]:
        piece = text[self.emitted :]
        if not piece:
            return []
        call: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
        if self.emitted == 0:
            call = {
                "index": 0,
                "id": self.call_id,
                "type": "function",
                "function": {"name": self.plan.named, "arguments": piece},
            }
        self.emitted = len(text)
        return [{"tool_calls": [call]}]

    @staticmethod
    def _calls(calls: list[dict[str, str]]) -> list[dict[str, Any]]:
        return [{"tool_calls": [{"index": k, **obj}]} for k, obj in enumerate(tool_call_objects(calls))]
