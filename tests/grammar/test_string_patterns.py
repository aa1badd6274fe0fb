"""The shortest ways to a pattern's match that the JSON guard steers an open string along
(grammar/string_patterns.py): each is checked by the `regex` module's own search."""

from __future__ import annotations

import pytest
import regex

from plait.grammar.string_patterns import completions, schema_patterns, shortest_matches

PATTERNS = [
    "^(.+\\/)+(.+)@.+$|^docker:\\/\\/.+$",
    "^\\$\\{\\{(.|[\\r\\n])*\\}\\}$",
    "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}$",
    "^(~>|>|>=|=|<=|<) (\\d+(?:\\.\\d+)?)$",
    "^[\\S]+@[\\S]+\\.[\\S]{2,}$",
    "^[^,\\t\\n\\v\\f\\r]+$",
    "sha256-[A-Za-z0-9+/]{3}=",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_each_shortest_match_matches(pattern):
    found = shortest_matches(pattern)
    assert found and all(regex.search(pattern, m) for m in found)


def test_a_pattern_that_needs_a_backslash_gets_one():
    """BizTalk's `Path`: `\\w+[\\\\](\\w+\\.)*\\w+\\.dll`, a literal backslash (a JSON string writes it
    escaped: the guard's business, not this module's)."""
    pattern = "\\w+[\\\\](\\w+\\.)*\\w+\\.dll"
    assert shortest_matches(pattern) == ("a\\a.dll",)
    assert completions((pattern,), b"bins\\\\x") == [".dll"]  # (written: `bins\\x`, JSON-escaped)


def test_every_top_level_alternative_is_a_way():
    assert shortest_matches(PATTERNS[0]) == ("a/a@a", "docker://a")


def test_completions_continue_what_is_written():
    assert completions((PATTERNS[0],), b"git-clone/x") == ["@a"]
    assert completions((PATTERNS[0],), b"git-clone-1.0") == ["/a@a"]
    assert completions(("^x",), b"abc") == []  # (no suffix can help: none)
    assert completions(("[", PATTERNS[4]), b"me") == ["@a.aa"]  # (a pattern that does not compile: skipped)


def test_unparsed_patterns_give_no_way():
    assert shortest_matches("(a)\\1") == ()  # a back-reference
    assert shortest_matches("[") == ()


def test_schema_patterns_are_collected_once():
    schema = {
        "properties": {"a": {"pattern": "x"}, "b": {"items": {"pattern": "x"}}},
        "patternProperties": {"^k": {"pattern": "y"}},
    }
    assert sorted(schema_patterns(schema)) == ["^k", "x", "y"]
