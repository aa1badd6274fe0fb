"""The JSON length guards (grammar/json_guard.py) against an adversary: a "model" that always
picks the allowed token that makes the document longest (more digits, more string, one more array
item). With the guards every document ends valid within max_tokens; without them it never ends."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from plait.grammar import GrammarSpec, allocate_token_bitmask, make_backend, tokenizer_info
from plait.grammar.bitmask import unpack_bitmask
from plait.grammar.json_guard import (
    CLOSING_MARGIN,
    CLOSING_SHARE,
    JsonGuard,
    JsonLimits,
    _scan,
    _State,
    guard_tables,
    guarded,
)

VOCAB = 49152
EOS = 2
WANDER = {
    "type": "object",
    "properties": {
        "x": {"type": "number"},
        "s": {"type": "string"},
        "a": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["x", "s", "a"],
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def info(smollm2_tokenizer):
    return tokenizer_info(smollm2_tokenizer, VOCAB, [EOS])


@pytest.fixture(scope="module", params=["llguidance", "xgrammar"])
def backend(request, info):
    try:
        return make_backend(request.param, info)
    except ImportError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def adversary(info):
    """Token classes, best first: all digits; no quote or closing bracket (strings and arrays go
    on); anything else."""
    digits = torch.zeros(VOCAB, dtype=torch.bool)
    free = torch.zeros(VOCAB, dtype=torch.bool)
    for i, b in info.normal_tokens():
        digits[i] = b.isdigit()
        free[i] = not any(c in b for c in b'"}]') and not b.isspace()
    return digits, free


def walk(matcher, adversary, max_tokens: int) -> tuple[bytes, bool]:
    """Run the adversary for up to max_tokens; (the text, whether EOS ended it)."""
    digits, free = adversary
    mask = allocate_token_bitmask(1, VOCAB)
    out = b""
    for _ in range(max_tokens):
        matcher.fill_mask(mask, 0)
        allowed = unpack_bitmask(mask, VOCAB)[0]
        for cls in (allowed & digits, allowed & free, allowed):
            ids = cls.nonzero().flatten()
            if len(ids):
                tok = int(ids[0])
                break
        else:
            raise AssertionError("the mask allows nothing")
        assert matcher.accept(tok)
        if tok == EOS:
            return out, True
        out += walk.bytes_of[tok]
    return out, False


def guard(backend, info, schema, limits: JsonLimits, max_tokens: int):
    spec = GrammarSpec.from_json_schema(schema)
    return guarded(backend.compile(spec).matcher(), spec, info, limits, max_tokens)


@pytest.fixture(autouse=True)
def _bytes(info):
    walk.bytes_of = info.token_bytes


def test_scan_tracks_numbers_strings_and_depth():
    s = _scan(_State(), b'{"a": [-12.345e+67')
    assert (s.in_number, s.part, s.run, s.depth, s.in_string) == (True, 2, 2, 2, False)
    s = _scan(_State(), '{"k": "ab\\"cé'.encode())
    assert (s.in_string, s.str_len, s.depth) == (True, 5, 1)  # the escape is one character, é one
    s = _scan(s, b'"}')
    assert (s.in_string, s.depth) == (False, 0)


def test_without_the_guards_the_adversary_never_ends(backend, info, adversary):
    """The control: the grammar alone lets it write digits / string until max_tokens."""
    m = guard(backend, info, WANDER, JsonLimits(0, 0), 10**6)
    text, ended = walk(m, adversary, 300)
    assert not ended and text.startswith(b'{"x": ')


@pytest.mark.parametrize("max_tokens", [30, 60, 120, 400])
def test_guarded_documents_end_valid_within_max_tokens(backend, info, adversary, max_tokens):
    m = guard(backend, info, WANDER, JsonLimits(19, 40), max_tokens)
    text, ended = walk(m, adversary, max_tokens)
    assert ended, text
    doc = json.loads(text)
    jsonschema.validate(doc, WANDER)
    whole, _, frac = text.split(b'"x": ')[1].split(b",")[0].lstrip(b"-").partition(b".")
    assert len(whole) <= 19 and len(frac.split(b"e")[0].split(b"E")[0]) <= 17
    assert len(doc["s"]) <= 40 + 16  # the cap, plus at most one token's characters


USES = {  # a GitHub workflow step's `uses`: the string cannot close before a `/` and an `@`
    "type": "object",
    "properties": {"uses": {"type": "string", "pattern": "^(.+\\/)+(.+)@.+$|^docker:\\/\\/.+$"}},
    "required": ["uses"],
}


DLL = {  # BizTalk's assembly `Path`: a literal backslash, written `\\` in the JSON string
    "type": "object",
    "properties": {"path": {"type": "string", "pattern": "\\w+[\\\\](\\w+\\.)*\\w+\\.dll"}},
    "required": ["path"],
}


@pytest.mark.parametrize("schema", [USES, DLL], ids=["uses", "dll"])
@pytest.mark.parametrize("steer", [True, False])
def test_a_string_its_pattern_keeps_open_is_steered_to_a_match(backend, info, adversary, steer, schema):
    """Past the string cap the adversary writes anything but what the pattern needs (`/` and
    `@`, a backslash); the guard follows the pattern's shortest way to a match and closes the
    string (without it: never). (xgrammar matches a pattern against the string's JSON text: after
    a backslash it takes `\\w`, not an escape, so the DLL path is llguidance's alone.)"""
    if schema is DLL and backend.name != "llguidance":
        pytest.skip("xgrammar reads the pattern's backslash as the JSON text's")
    m = guard(backend, info, schema, JsonLimits(19, 40), 160)
    if not steer:
        m._patterns = ()
    text, ended = walk(m, adversary, 160)
    assert ended == steer, text
    if steer:
        jsonschema.validate(json.loads(text), schema)


def test_a_long_close_starts_early_enough(backend, info, adversary):
    """Twenty required keys, each an array the adversary keeps filling: the shortest close (each
    key spelt a character a token, as the adversary does) is ~180 tokens, so the guard must
    estimate it long before the last few dozen."""
    schema = {
        "type": "object",
        "properties": {f"key_{i}": {"type": "array", "items": {"type": "integer"}} for i in range(20)},
        "required": [f"key_{i}" for i in range(20)],
    }
    m = guard(backend, info, schema, JsonLimits(19, 40), 600)
    text, ended = walk(m, adversary, 600)
    assert ended, text[-200:]
    jsonschema.validate(json.loads(text), schema)


def slow_walk(matcher, info, max_tokens: int) -> tuple[bytes, bool]:
    """A "model" whose closing choices take longer than the guard's walk: among the allowed
    tokens it takes the shortest (a key a character a token, `" "` before `""`), the highest id
    among equals."""
    lengths = torch.tensor(
        [len(b) if b else 10**6 for b in info.token_bytes] + [10**6] * (VOCAB - len(info.token_bytes))
    )
    lengths[EOS] = 10**5  # EOS only where nothing else is allowed
    mask = allocate_token_bitmask(1, VOCAB)
    out = b""
    for _ in range(max_tokens):
        matcher.fill_mask(mask, 0)
        allowed = unpack_bitmask(mask, VOCAB)[0]
        cost = torch.where(allowed, lengths * VOCAB - torch.arange(VOCAB), torch.iinfo(torch.int64).max)
        tok = int(cost.argmin())
        assert allowed[tok], "the mask allows nothing"
        assert matcher.accept(tok)
        if tok == EOS:
            return out, True
        out += info.token_bytes[tok]
    return out, False


@pytest.mark.parametrize("max_tokens", [400, 500])
def test_the_close_follows_the_walk_not_the_model(backend, info, max_tokens, monkeypatch):
    """Twelve required keys with long names (the shortest document is ~190 tokens): the walk
    writes a key in a few tokens, the model above in one a character. Once closing begins the
    document ends along the walk, so it still ends valid within max_tokens; left to pick among
    closing tokens, the model is cut (on xgrammar: llguidance lets a key be written only in its
    canonical tokens, so there the model cannot be slower than the walk)."""
    schema = {
        "type": "object",
        "properties": {f"a_rather_long_key_name_{i}": {"type": "string"} for i in range(12)},
        "required": [f"a_rather_long_key_name_{i}" for i in range(12)],
    }
    m = guard(backend, info, schema, JsonLimits(19, 40), max_tokens)
    text, ended = slow_walk(m, info, max_tokens)
    assert ended, text[-200:]
    jsonschema.validate(json.loads(text), schema)
    from plait.grammar import json_guard

    monkeypatch.setattr(json_guard, "SOFT_FACTOR", 1)  # the control: no early closing zone, and
    monkeypatch.setattr(json_guard, "SOFT_EXTRA", 0)
    m = guard(backend, info, schema, JsonLimits(19, 40), max_tokens)
    m._room = 0  # (no room kept for one more structure)
    m._path_failed = True  # closing tiers only, the model picks among them
    text, ended = slow_walk(m, info, max_tokens)
    assert ended == (backend.name == "llguidance")


@pytest.mark.parametrize("max_tokens", [150, 237, 400])
def test_no_new_item_that_cannot_fit(backend, info, adversary, max_tokens):
    """An adversary that keeps adding array items, each an object of two required keys: near the
    end the guard prefers closing the array to opening another item, so the document ends valid
    whatever the budget. On llguidance (the JSON default), which writes a key in its canonical
    tokens. (Where a new item's close is longer than the soft zone's SOFT_EXTRA, as on xgrammar
    when a key is spelt a character a token, it can still be opened just before the zone and not
    fit: the estimate sees it only once it is open.)"""
    if backend.name != "llguidance":
        pytest.skip("xgrammar lets a key be spelt a character a token: see the docstring")
    item = {
        "type": "object",
        "properties": {"key_0": {"type": "integer"}, "key_1": {"type": "integer"}},
        "required": ["key_0", "key_1"],
    }
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": item}}, "required": ["items"]}
    m = guard(backend, info, schema, JsonLimits(19, 40), max_tokens)
    text, ended = walk(m, adversary, max_tokens)
    assert ended, text[-200:]
    jsonschema.validate(json.loads(text), schema)


def test_the_schema_wins_over_the_caps(backend, info, adversary):
    """A minLength above the string cap and a minimum above the digit cap are still met."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 30}, "n": {"type": "integer", "minimum": 10**12}},
        "required": ["s", "n"],
    }
    m = guard(backend, info, schema, JsonLimits(3, 5), 200)
    text, ended = walk(m, adversary, 200)
    assert ended, text
    jsonschema.validate(json.loads(text), schema)


def test_rollback_restores_the_guard(backend, info, tokenizer):
    m = guard(backend, info, WANDER, JsonLimits(19, 40), 100)
    assert isinstance(m, JsonGuard)
    for t in tokenizer.encode('{"x": 12', add_special_tokens=False):
        assert m.accept(t)
    before = m.state
    for t in tokenizer.encode('345', add_special_tokens=False):
        assert m.accept(t)
    assert m.state.run > before.run
    m.rollback(len(tokenizer.encode('345', add_special_tokens=False)))
    assert m.state == before


def test_only_json_grammars_are_guarded(backend, info):
    spec = GrammarSpec.from_regex("[0-9]+")
    inner = backend.compile(spec).matcher()
    assert guarded(inner, spec, info, JsonLimits(), 10) is inner
    assert guard_tables(info) is guard_tables(info)  # built once per tokenizer


@pytest.mark.parametrize("max_tokens", [150, 237, 400])
def test_no_new_item_that_cannot_fit_on_either_backend(backend, info, adversary, max_tokens):
    """An array of items of required keys (dependabot's `updates`, a GitHub schema's list of
    missions): the soft zone keeps room for one more item, so an item the estimate does not see
    yet (it is not open) is not opened just outside the zone, even where a key is spelt a
    character a token."""
    keys = [f"a_longer_key_{i}" for i in range(4)]
    item = {"type": "object", "properties": {k: {"type": "integer"} for k in keys}, "required": keys}
    schema = {
        "type": "object",
        "properties": {"updates": {"type": "array", "items": item}},
        "required": ["updates"],
    }
    m = guard(backend, info, schema, JsonLimits(19, 40), max_tokens)
    text, ended = walk(m, adversary, max_tokens)
    assert ended, text[-200:]
    jsonschema.validate(json.loads(text), schema)


LONG_KEYS = {
    "type": "object",
    "properties": {f"a_rather_long_key_name_{i}": {"type": "integer"} for i in range(12)},
    "required": [f"a_rather_long_key_name_{i}" for i in range(12)],
}


def test_the_walk_writes_forced_text_without_masks(backend, info, monkeypatch):
    """Where the grammar forces text (each required key's name and `": "`), the walk takes that
    text's longest token without computing a mask: far fewer masks than steps, and the walk still
    ends in a document that validates, one token a step as the close later writes it."""
    m = guard(backend, info, LONG_KEYS, JsonLimits(19, 40), 1000)
    inner = m.inner
    masks = []
    fill = type(inner).fill_mask
    monkeypatch.setattr(type(inner), "fill_mask", lambda self, b, r: (masks.append(1), fill(self, b, r))[1])
    path: list[int] = []
    steps = m._shortest_close(path=path)
    assert steps == len(path) + 1 and inner.num_accepted == 0  # (EOS counted; rolled back)
    assert len(masks) < steps // 2, (len(masks), steps)
    for tok in path:
        assert m.accept(tok)
    assert m.can_end()
    text = b"".join(info.token_bytes[t] for t in path)
    jsonschema.validate(json.loads(text), LONG_KEYS)


def test_closing_begins_on_a_fresh_estimate(backend, info):
    """A "model" that writes the document the shortest way itself (the slow walk's choices): an
    estimate made tokens earlier says the close must begin long before it must. Closing begins only
    where a walk from that very token says so, and the document still ends valid."""
    max_tokens = 260
    m = guard(backend, info, LONG_KEYS, JsonLimits(19, 40), max_tokens)
    mask = allocate_token_bitmask(1, VOCAB)
    lengths = torch.tensor(
        [len(b) if b else 10**6 for b in info.token_bytes] + [10**6] * (VOCAB - len(info.token_bytes))
    )
    lengths[EOS] = 10**5
    began = None
    for _ in range(max_tokens):
        m.fill_mask(mask, 0)
        if began is None and m._closing_now:
            began = max_tokens - m.num_accepted
            fresh = m._shortest_close()  # (the guard's own walk from here, rolled back)
            assert began <= fresh + CLOSING_MARGIN + fresh // CLOSING_SHARE, (began, fresh)
        allowed = unpack_bitmask(mask, VOCAB)[0]
        tok = int(torch.where(allowed, lengths * VOCAB - torch.arange(VOCAB), torch.iinfo(torch.int64).max).argmin())
        assert m.accept(tok)
        if tok == EOS:
            break
    assert began is not None and m.is_finished()


MANY_OPTIONAL = {  # sp_303's shape: items of many optional keys, the required one declared last
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "properties": {**{f"key{i:02d}": {"type": "string"} for i in range(40)}, "zz": {"type": "string"}},
        "required": ["zz"],
        "additionalProperties": False,
    },
}


def test_the_walk_skips_optional_keys(backend, info, tokenizer):
    """At a key's start the walk writes the next required key, not the optional ones before it:
    from `[{"key00": "a", "` the close is `zz": ""}]`, a few tokens (taking the longest token
    instead wrote every optional key: ~160)."""
    m = guard(backend, info, MANY_OPTIONAL, JsonLimits(19, 40), 2000)
    for t in tokenizer.encode('[{"key00": "a", "', add_special_tokens=False):
        assert m.accept(t)
    path: list[int] = []
    steps = m._shortest_close(path=path)
    assert steps <= 12, (steps, b"".join(info.token_bytes[t] for t in path))
    text = b'[{"key00": "a", "' + b"".join(info.token_bytes[t] for t in path)
    jsonschema.validate(json.loads(text), MANY_OPTIONAL)


@pytest.mark.parametrize("max_tokens", [120, 200])
def test_many_optional_keys_still_end_valid(backend, info, adversary, max_tokens):
    """The adversary writes key after key; near the end the guard steers each key to the required
    one, so the document closes in time."""
    m = guard(backend, info, MANY_OPTIONAL, JsonLimits(19, 16), max_tokens)
    text, ended = walk(m, adversary, max_tokens)
    assert ended, text[-200:]
    jsonschema.validate(json.loads(text), MANY_OPTIONAL)
