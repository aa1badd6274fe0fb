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
        at = "/".join(map(str, e.path))  # (ends with the keyword: `.../pattern`)
        raise ApiError(400, f"{where} is not a valid JSON schema: at '{at}': {e.message}") from None
    if (ref := remote_ref(schema)) is not None:
        raise ApiError(
            400,
            f"{where}: $ref {ref!r} points outside the schema; plait does not fetch remote schemas "
            "(inline the definition)",
        )


def remote_ref(schema: Any) -> str | None:
    """The first `$ref` that names a resource the schema does not hold (another document, fetched by
    URL), or None: no grammar can follow it, and no validator could check the output against it."""
    from urllib.parse import urldefrag, urljoin

    def walk(node: Any, base: str, ids: set[str], refs: list[tuple[str, str]]) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x, base, ids, refs)
        elif isinstance(node, dict):
            if isinstance(node.get("$id"), str):
                base = urldefrag(urljoin(base, node["$id"]))[0]
                ids.add(base)
            if isinstance(node.get("$ref"), str):
                refs.append((base, node["$ref"]))
            for k, v in node.items():
                if k not in ("enum", "const", "default", "examples"):  # data, not schemas
                    walk(v, base, ids, refs)

    ids: set[str] = {""}
    refs: list[tuple[str, str]] = []
    walk(schema, "", ids, refs)
    for base, ref in refs:
        if urldefrag(urljoin(base, ref))[0] not in ids:
            return ref
    return None


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
