"""`stop_regex`: a gen stops where its text first matches one of these regular expressions.

The model stops at the token where a pattern first matches the text generated so far, and the
matched text stays in the output (SGLang 0.5.5 trims only literal stop strings). The frontend
applies this itself, on the text as it streams in, so it holds on every backend; the request
also carries `stop_regex`, so plait's (and SGLang's) server stops generating there too instead of
running on to max_tokens.
"""

from __future__ import annotations

import functools
import re
from typing import Any


def patterns(stop_regex: Any) -> list[str]:
    """`stop_regex` as a list (None, one pattern or a list)."""
    if not stop_regex:
        return []
    return [stop_regex] if isinstance(stop_regex, str) else list(stop_regex)


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


# Patterns that can match a prefix of a text but not the text itself (they look at where the text
# ends): for these a search of the whole text does not tell whether some prefix matches.
_END_SENSITIVE = ("$", "\\Z", "(?=", "(?!", "\\b", "\\B")


def _may_skip(pattern: str, regex: re.Pattern, text: str) -> bool:
    """Whether no prefix of `text` can match: the pattern is not end-sensitive and `text` has no match."""
    return not any(tok in pattern for tok in _END_SENSITIVE) and regex.search(text) is None


def first_match_end(text: str, stop_regex: list[str], since: int = 0) -> tuple[int, str] | None:
    """The shortest prefix of `text` (longer than `since` characters, the part known to hold no
    match) in which a pattern matches, as (its length, the pattern); None if there is none."""
    regexes = [(p, r) for p, r in ((p, _compiled(p)) for p in stop_regex) if not _may_skip(p, r, text)]
    if not regexes:
        return None
    for end in range(max(since, 0) + 1, len(text) + 1):
        for p, r in regexes:
            if r.search(text, 0, end):
                return end, p
    return None


def cut(text: str, meta: dict, stop_regex: list[str]) -> tuple[str, dict]:
    """A finished output cut where a pattern first matched, its finish reason saying so."""
    found = first_match_end(text, stop_regex) if stop_regex else None
    if found is None:
        return text, meta
    end, pattern = found
    return text[:end], matched(meta, pattern)


def matched(meta: dict, pattern: str) -> dict:
    """`meta` with the finish reason SGLang reports for a stop_regex match."""
    return {**(meta or {}), "finish_reason": {"type": "stop", "matched": pattern}}
