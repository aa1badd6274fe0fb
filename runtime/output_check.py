"""The last check on a JSON-schema-constrained output: the finished document is validated with a
real JSON Schema validator (`jsonschema`) before it is returned.

The grammar backends enforce most schemas exactly, but some keywords only approximately
(llguidance's lenient mode reads `oneOf` as `anyOf` and ignores `not`, `if`/`then`, `uniqueItems`,
...; xgrammar, the fallback, approximates others). A document that finished under such a grammar
but does not validate must never come back as an ordinary "stop": the engine samples it again
while `json_resample` allows, then ends the request as an abort whose message starts with
`INVALID_OUTPUT` and names the failing keyword and path (the HTTP layer answers 500 with it)."""

from __future__ import annotations

import functools
import json
import re

INVALID_OUTPUT = "invalid output"


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str):
    from plait.grammar.schema_keywords import validator_class
    from plait.grammar.string_patterns import schema_patterns

    schema = json.loads(schema_text)
    cls = validator_class(schema)
    if any(not _python_regex(p) for p in schema_patterns(schema)):
        cls = _ecma_patterns(cls)
    return cls(schema)


def _python_regex(pattern: str) -> bool:
    try:
        re.compile(pattern)
        return True
    except re.error:
        return False


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str):
    import regex

    return regex.compile(pattern)


def _ecma_patterns(cls):
    r"""`cls` with `pattern`, `patternProperties` and `additionalProperties` matching through the
    `regex` module: a schema's patterns are ECMA-262, and Python's `re` refuses some that `regex`
    reads (`\p{Letter}`, SchemaStore's flow.json), which jsonschema's own keywords then raise on."""
    from jsonschema import ValidationError, validators

    def search(pattern: str, text: str) -> bool:
        return _compiled(pattern).search(text) is not None

    def pattern(validator, patrn, instance, schema):
        if validator.is_type(instance, "string") and not search(patrn, instance):
            yield ValidationError(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(validator, patterns, instance, schema):
        if validator.is_type(instance, "object"):
            for p, sub in patterns.items():
                for k, v in instance.items():
                    if search(p, k):
                        yield from validator.descend(v, sub, path=k, schema_path=p)

    def additional_properties(validator, extra, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        props, patterns = schema.get("properties", {}), list(schema.get("patternProperties", {}))
        extras = sorted(k for k in instance if k not in props and not any(search(p, k) for p in patterns))
        if validator.is_type(extra, "object"):
            for k in extras:
                yield from validator.descend(instance[k], extra, path=k)
        elif extra is False and extras:
            yield ValidationError(f"Additional properties are not allowed ({', '.join(map(repr, extras))} unexpected)")

    return validators.extend(
        cls,
        {"pattern": pattern, "patternProperties": pattern_properties, "additionalProperties": additional_properties},
    )


def schema_violation(schema_text: str, text: str) -> str | None:
    """Why `text` is not a document valid under the JSON schema `schema_text` (None if it is)."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        return f"{INVALID_OUTPUT}: the document is not JSON ({e})"
    try:
        error = next(iter(_validator(schema_text).iter_errors(doc)), None)
    except Exception as e:  # noqa: BLE001 - a reference the validator cannot follow, a regex it cannot read
        # (the server refuses such schemas up front where it can tell; never returned unchecked)
        return f"{INVALID_OUTPUT}: the document could not be checked against the schema ({type(e).__name__}: {e})"[:500]
    if error is None:
        return None
    where = "".join(f"[{p!r}]" for p in error.absolute_path) or "the root"
    # a `false` subschema has no keyword of its own: the one that holds it (propertyNames, ...)
    keyword = error.validator or next((str(p) for p in reversed(error.schema_path)), "false")
    return (
        f"{INVALID_OUTPUT}: the generated document breaks the schema's '{keyword}' at {where}: "
        f"{error.message[:300]} (a keyword the grammar backend approximates; the document is withheld)"
    )


def answer_part(text: str, start: str | None, end: str | None) -> str:
    """The part of an output the constraint bound: after the reasoning section (`start` ... `end`,
    see `SamplingParams.reasoning_end`), or all of it."""
    if end is None or (start is not None and not text.lstrip().startswith(start)):
        return text
    at = text.find(end)
    return text[at + len(end) :] if at >= 0 else text
