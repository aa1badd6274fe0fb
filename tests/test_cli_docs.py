"""docs/server_args.md is generated from the parser and ServerArgs, and every engine field has a flag."""

from __future__ import annotations

import dataclasses
import os

from plait.cli import _ENGINE_OPTIONS, build_parser, serve_flags_markdown
from plait.runtime.server_args import PYTHON_ONLY, ServerArgs

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "server_args.md")


def test_server_args_doc_is_current():
    with open(DOC) as f:
        assert f.read() == serve_flags_markdown(), "regenerate docs/server_args.md (command in its header)"


def test_every_engine_field_is_a_serve_flag():
    ns = build_parser().parse_args(["serve"])
    fields = [f.name for f in dataclasses.fields(ServerArgs)]
    assert set(_ENGINE_OPTIONS) == set(fields) - set(PYTHON_ONLY)
    assert [f for f in _ENGINE_OPTIONS if not hasattr(ns, f)] == []
    doc = serve_flags_markdown()
    assert all(f"`--{f.replace('_', '-')}`" in doc for f in _ENGINE_OPTIONS)


def test_flags_reach_server_args():
    ns = build_parser().parse_args(
        [
            "serve",
            "--json-max-string-length",
            "7",
            "--dist-timeout",
            "12",
            "--revision",
            "main",
            "--schedule-policy",
            "fcfs",
        ]
    )
    args = ServerArgs.from_kwargs(**{k: getattr(ns, k) for k in _ENGINE_OPTIONS if getattr(ns, k) is not None})
    assert (args.json_max_string_length, args.dist_timeout, args.revision, args.schedule_policy) == (
        7,
        12.0,
        "main",
        "fcfs",
    )


def test_engine_flags_are_defined_once_in_server_args():
    """Each engine flag's help and choices are its ServerArgs field's, and its parsed value is None
    (so the engine's default applies) unless given: the flag adds no second default."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    actions = {a.dest: a for a in serve._actions}
    for f in dataclasses.fields(ServerArgs):
        if f.name in PYTHON_ONLY:
            continue
        a = actions[f.name]
        assert a.help == f.metadata["help"] and a.help, f.name
        assert (tuple(a.choices) if a.choices else None) == f.metadata["choices"], f.name
        if f.name != "log_level":  # the server's own default: info
            assert a.default in (None, False), f.name
    ns = build_parser().parse_args(["serve"])
    assert (
        ServerArgs.from_kwargs(**{k: getattr(ns, k) for k in _ENGINE_OPTIONS if getattr(ns, k) is not None}).log_level
        == "info"
    )
