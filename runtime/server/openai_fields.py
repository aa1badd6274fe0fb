"""Field checks shared by OpenAI request parsing and tool parsing: typed fields, JSON schemas,
message content as text.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from ...grammar.schema_keywords import validator_class
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
    if (problem := schema_problem(json.dumps(schema, sort_keys=True))) is not None:
        raise ApiError(400, f"{where}{problem}")


@functools.lru_cache(maxsize=1024)
def schema_problem(schema_text: str) -> str | None:
    """What makes a schema unusable (the 400's text after the field's name), or None. Cached by
    the schema's text: the metaschema check takes milliseconds on a large schema, and a service
    sees the same schemas request after request."""
    schema = json.loads(schema_text)
    error = next(iter(_meta_validator(validator_class(schema)).iter_errors(schema)), None)
    if error is not None:
        at = "/".join(map(str, error.path))  # (ends with the keyword: `.../pattern`)
        return f" is not a valid JSON schema: at '{at}': {error.message}"
    if (ref := remote_ref(schema)) is not None:
        return f": $ref {ref!r} points outside the schema; plait does not fetch remote schemas (inline the definition)"
    if (ref := dangling_ref(schema)) is not None:
        return f": $ref {ref!r} points at nothing in the schema"
    return None


def dangling_ref(schema: Any) -> str | None:
    """The first local `$ref` (a JSON pointer, read within the resource that holds it, as the
    validator reads it) that names nothing in the schema, or None: no grammar can follow it, and the
    validator that checks the output stops there."""
    from ...grammar.schema_keywords import resolve_local_ref, static_refs, walk_schema

    resolved = static_refs(schema)  # (the same nodes in the same order, pointers the document's)
    for written, node in zip(walk_schema(schema), walk_schema(resolved)):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and resolve_local_ref(resolved, ref) is None:
            return written.get("$ref", ref)
    return None


@functools.lru_cache(maxsize=8)
def _meta_validator(cls):
    """A validator of schemas of `cls`'s draft against its metaschema (what `check_schema` does),
    with the `regex` format read as ECMA-262 through the `regex` module: Python's `re` refuses
    `\\p{Letter}` and other patterns every JSON Schema validator of the field accepts."""
    import regex
    from jsonschema import FormatChecker, validators

    meta = validators.validator_for(cls.META_SCHEMA, default=cls)
    checker = FormatChecker(())
    checker.checkers = dict(meta.FORMAT_CHECKER.checkers)
    checker.checks("regex", raises=regex.error)(lambda v: not isinstance(v, str) or bool(regex.compile(v)))
    return meta(cls.META_SCHEMA, format_checker=checker)


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
