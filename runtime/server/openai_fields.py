"""Field checks shared by OpenAI request parsing and tool parsing: typed fields, JSON schemas,
message content as text.
"""

from __future__ import annotations

from typing import Any

from .http_common import ApiError

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


# --- parsing ----------------------------------------------------------------------------------
def typed_field(body: dict[str, Any], name: str, check, expected: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise ApiError(400, f"{name} must be {expected}, got {type(value).__name__}")
    return value


def is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def require_schema(schema: Any, where: str) -> None:
    """400 for a JSON schema that is not even well-formed (checked with jsonschema's metaschema
    where that package is installed; the grammar compiler reports the rest)."""
    if not isinstance(schema, (dict, bool)):
        raise ApiError(400, f"{where} must be a JSON schema object, got {type(schema).__name__}")
    try:
        from jsonschema import exceptions, validators
    except ImportError:  # not a runtime dependency
        return
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as e:
        raise ApiError(400, f"{where} is not a valid JSON schema: {e.message}") from None


def content_text(content: Any, i: int) -> str:
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
