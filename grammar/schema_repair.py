"""Parts of a schema llguidance refuses to compile although they mean something, relaxed where its
error message points, for its lenient mode (the output check validates every document against the
schema as written, so a relaxed keyword can let a document through to the check, never past it):

- a regex its engine cannot parse: JavaScript's literal braces escaped (`^\\${.*}$`, exact), else
  its look-arounds and word boundaries left out (a superset), else the `pattern` dropped (a
  back-reference) or the `patternProperties` entry (its keys then fall to `additionalProperties`);
  a pattern that is no regex at all stays, and the schema with it is refused;
- `patternProperties` whose regexes overlap (llguidance wants them disjoint): the one whose schema
  is `false` dropped (SchemaStore's GitLab CI put an `additionalProperties: false` among them), else
  both as one entry, the union of the regexes with the anyOf of the schemas.

Each repair is a superset of the documents (or the same ones), never a subset that could leave no
document to write."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

_QUANTIFIER = re.compile(r"\{\d+(?:,\d*)?\}")
_OVERLAP = re.compile(r"patternProperty regexes /(.*?)/ and /(.*?)/ are not disjoint")
# where llguidance's messages quote a regex: "regex parse error:\n    <regex>\n", "in regex /<regex>/"
_NAMED = re.compile(r"regex parse error:\n {4}(.*)\n|in regex /(.*)/$", re.M)


def js_braces(pattern: str) -> str:
    """`pattern` with the braces that JavaScript reads as literal characters (not a `{n}`, `{n,}`,
    `{n,m}` quantifier, nor the braces of `\\p{...}` / `\\u{...}` / `\\x{...}`) escaped."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if pattern[i + 1 : i + 2] in ("p", "P", "u", "x") and pattern[i + 2 : i + 3] == "{":
                end = pattern.find("}", i)
                end = len(pattern) - 1 if end < 0 else end
                out.append(pattern[i : end + 1])
                i = end + 1
            else:
                out.append(pattern[i : i + 2])
                i += 2
            continue
        if in_class or c not in "[{}":
            in_class = in_class and c != "]"
            out.append(c)
        elif c == "[":
            in_class = True
            out.append(c)
        elif c == "{" and (m := _QUANTIFIER.match(pattern, i)):
            out.append(m.group())
            i = m.end()
            continue
        else:
            out.append("\\" + c)
        i += 1
    return "".join(out)


def _is_regex(p: str) -> bool:
    """Whether `p` is a regex at all (read by the `regex` module, the nearest to ECMA-262)."""
    import regex

    try:
        regex.compile(p)
        return True
    except regex.error:
        return False


def without_assertions(pattern: str) -> str:
    """`pattern` without its look-arounds (`(?=...)`, `(?!...)`, `(?<=...)`, `(?<!...)`) and word
    boundaries (`\\b`, `\\B`): what llguidance's regexes cannot express, left out so that the rest
    still holds (`^(?!all$).*$` as `^.*$`, a superset)."""
    out, skipping = [], 0  # skipping: the depth of parentheses inside a look-around left out
    for i, atom, in_class in _atoms(pattern):
        if skipping:
            if not in_class:
                skipping += (atom == "(") - (atom == ")")
            continue
        if in_class:
            out.append(atom)
        elif atom == "(" and pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            skipping = 1
        elif atom not in ("\\b", "\\B"):
            out.append(atom)
    return "".join(out)


def _atoms(pattern: str) -> Iterator[tuple[int, str, bool]]:
    """Each escape (two characters) or character of `pattern`, with its index and whether it is
    inside a character class (a class's own `[` is not, its closing `]` is)."""
    i, in_class = 0, False
    while i < len(pattern):
        atom = pattern[i : i + 2] if pattern[i] == "\\" else pattern[i]
        yield i, atom, in_class
        if len(atom) == 1:
            in_class = atom != "]" if in_class else atom == "["
        i += len(atom)


def repair(schema: Any, error: str) -> Any | None:
    """A copy of `schema` relaxed where llguidance's `error` points (see the module docstring), or
    None where the error names nothing this module relaxes."""
    changed = [False]
    named = {x for groups in _NAMED.findall(error) for x in groups if x}

    def fix_regex(p: str) -> str | None:
        """The regex to write instead of `p` where the error is about it (None: drop it). One that
        is not a regex at all (`([`) stays, and so does the error: the schema is malformed."""
        if p not in named and not (len(p) >= 4 and p in error) or not _is_regex(p):
            return p
        changed[0] = True
        for fixed in (js_braces(p), without_assertions(p)):
            if fixed != p:
                return fixed or None
        return None

    overlap = _OVERLAP.search(error)

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: walk(v) if k not in ("enum", "const", "default", "examples") else v for k, v in node.items()}
        if isinstance(out.get("pattern"), str):
            p = fix_regex(out["pattern"])
            if p is None:
                del out["pattern"]
            else:
                out["pattern"] = p
        pp = out.get("patternProperties")
        if isinstance(pp, dict):
            if overlap and overlap.group(1) in pp and overlap.group(2) in pp:
                pp = _merged_overlap(pp, overlap.group(1), overlap.group(2))
                changed[0] = True
            fixed = {}
            for key, sub in pp.items():
                k = fix_regex(key)
                if k is not None:
                    fixed[k] = sub
            out["patternProperties"] = fixed
        return out

    fixed = walk(schema)
    return fixed if changed[0] else None


def _merged_overlap(pp: dict, a: str, b: str) -> dict:
    """`patternProperties` without the overlap of regexes `a` and `b`: the one with a `false` schema
    dropped, else one entry for both (a superset: a key of both had to meet both)."""
    out = dict(pp)
    if out[b] is False:
        del out[b]
    elif out[a] is False:
        del out[a]
    else:
        merged = {"anyOf": [out.pop(a), out.pop(b)]}
        out[f"(?:{a})|(?:{b})"] = merged
    return out
