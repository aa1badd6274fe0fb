"""Ways to finish a JSON string that a schema's `pattern` holds, for the length guard.

A string under `pattern` can only close once the pattern matches: `^(.+/)+(.+)@.+$` (a GitHub
action's `uses`) needs a `/` and an `@` that a small model may never write, and it then runs on
until max_tokens, the grammar allowing every character but the closing quote. Here: the shortest
string a pattern matches, from its parse tree, and the shortest suffix of it that makes the text so
far match, so that the guard can steer such a string to a close (json_guard.py)."""

from __future__ import annotations

import functools
import json
from typing import Any

try:  # private modules, only read for a pattern's parse tree (Python 3.11+; 3.10 named them sre_*)
    from re import _constants as C
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_constants as C  # noqa: N812
    import sre_parse

import regex

# characters tried first for a class (a word character, a digit, ...), then any printable one
_PREFERRED = "a0A_-. /:"
# (the quote and the backslash last: a JSON string writes them escaped, two characters each)
_PRINTABLE = _PREFERRED + "".join(chr(c) for c in range(33, 127) if chr(c) not in _PREFERRED + '"\\') + '"\\'
_MAX_REPEAT_WRITTEN = 64  # a minimum count beyond this: no short way to finish


def schema_patterns(schema: Any) -> tuple[str, ...]:
    """Every string pattern of a schema (`pattern`, `patternProperties`' names), each once."""
    found: dict[str, None] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found[node["pattern"]] = None
            if isinstance(node.get("patternProperties"), dict):
                found.update(dict.fromkeys(node["patternProperties"]))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return tuple(found)


@functools.lru_cache(maxsize=4096)
def shortest_matches(pattern: str) -> tuple[str, ...]:
    """Shortest strings `pattern` matches, one per top-level alternative, of printable characters
    (none where the pattern does not parse, holds back-references, or needs another character);
    as text, not as a JSON string writes it (`"` and `\\` are escaped there)."""
    try:
        items = sre_parse.parse(pattern)
    except Exception:  # noqa: BLE001 (a syntax Python's parser lacks: no completion)
        return ()
    body = [(op, av) for op, av in items if op is not C.AT]  # (the parser moves a shared `^` out)
    alternatives = body[0][1][1] if len(body) == 1 and body[0][0] is C.BRANCH else [items]
    return tuple(s for s in map(_shortest, alternatives) if s is not None)


def _shortest(items) -> str | None:
    out = []
    for op, av in items:
        if op is C.LITERAL:
            ch = chr(av)
            if not ch.isprintable():
                return None
            out.append(ch)
        elif op is C.ANY:
            out.append("a")
        elif op is C.NOT_LITERAL:
            out.append("a" if av != ord("a") else "b")
        elif op is C.IN:
            ch = next((c for c in _PRINTABLE if _in_class(av, c)), None)
            if ch is None:
                return None
            out.append(ch)
        elif op is C.BRANCH:
            options = [s for s in map(_shortest, av[1]) if s is not None]
            if not options:
                return None
            out.append(min(options, key=len))
        elif op is C.SUBPATTERN:
            s = _shortest(av[3])
            if s is None:
                return None
            out.append(s)
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", C.MAX_REPEAT)):
            lo, _, sub = av
            if lo > _MAX_REPEAT_WRITTEN:
                return None
            if lo:
                s = _shortest(sub)
                if s is None:
                    return None
                out.append(s * lo)
        elif op in (C.AT, C.ASSERT, C.ASSERT_NOT):
            continue  # (anchors and lookarounds: the regex check judges the result)
        else:
            return None
    return "".join(out)


def _in_class(items, ch: str) -> bool:
    code, hit, negate = ord(ch), False, False
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            hit = hit or code == av
        elif op is C.RANGE:
            hit = hit or av[0] <= code <= av[1]
        elif op is C.CATEGORY:
            hit = hit or _in_category(av, ch)
    return hit != negate


def _in_category(cat, ch: str) -> bool:
    if cat is C.CATEGORY_DIGIT:
        return ch.isdigit()
    if cat is C.CATEGORY_NOT_DIGIT:
        return not ch.isdigit()
    if cat is C.CATEGORY_WORD:
        return ch.isalnum() or ch == "_"
    if cat is C.CATEGORY_NOT_WORD:
        return not (ch.isalnum() or ch == "_")
    if cat is C.CATEGORY_SPACE:
        return ch.isspace()
    if cat is C.CATEGORY_NOT_SPACE:
        return not ch.isspace()
    return False


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str):
    try:
        return regex.compile(pattern)
    except Exception:  # noqa: BLE001
        return None


def completions(patterns: tuple[str, ...], written: bytes) -> list[str]:
    """Suffixes that make the string written so far (its JSON-escaped bytes, after the opening
    quote) match one of `patterns` (JSON Schema's `pattern` is a search, anchored only by its own
    `^` / `$`), shortest first: for each pattern, the shortest tail of its shortest match that
    works."""
    return list(_completions(patterns, written))


@functools.lru_cache(maxsize=4096)
def _completions(patterns: tuple[str, ...], written: bytes) -> tuple[str, ...]:
    # (cached: the guard's walks start again and again from the same open string)
    try:
        text = json.loads(b'"' + written + b'"')
    except ValueError:
        text = written.decode("utf-8", errors="ignore")
    found: set[str] = set()
    for p in patterns:
        if (compiled := _compiled(p)) is None:
            continue
        for m in shortest_matches(p):
            tail = next((m[i:] for i in range(len(m), -1, -1) if compiled.search(text + m[i:])), None)
            if tail is not None:
                found.add(tail)
    return tuple(sorted(found, key=lambda s: (len(s), s)))
