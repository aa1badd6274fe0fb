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

INVALID_OUTPUT = "invalid output"


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str):
    from jsonschema import validators

    schema = json.loads(schema_text)
    cls = validators.validator_for(schema)
    return cls(schema)


def schema_violation(schema_text: str, text: str) -> str | None:
    """Why `text` is not a document valid under the JSON schema `schema_text` (None if it is)."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        return f"{INVALID_OUTPUT}: the document is not JSON ({e})"
    error = next(iter(_validator(schema_text).iter_errors(doc)), None)
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
