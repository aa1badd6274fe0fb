"""plait.grammar: every backend against the real SmolLM2 tokenizer (vocab 49152).

Per backend: valid strings walk through token by token, invalid ones are rejected at the right
token, the mask agrees with accept, rollback restores the state, jump-forward text, bad specs
raise GrammarError, random walks from the mask validate; plus the bitmask kernel, the compile
cache and the outlines blow-up guard."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

from plait.grammar import (
    Grammar,
    GrammarBackend,
    GrammarCache,
    GrammarError,
    GrammarSpec,
    Matcher,
    TokenizerInfo,
    allocate_token_bitmask,
    apply_token_bitmask_,
    canonical_json,
    make_backend,
)
from plait.grammar.bitmask import _apply_torch, set_token_bits, unpack_bitmask
from plait.grammar.tokenizer_info import _bytes_to_unicode

VOCAB = 49152
EOS = 2  # <|im_end|>
BACKENDS = ("xgrammar", "outlines", "llguidance", "auto")

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tokenizer) -> GrammarBackend:
    try:
        return make_backend(request.param, tokenizer, VOCAB)
    except ImportError as e:
        pytest.skip(str(e))


_compiled: dict = {}


def compiled(backend: GrammarBackend, spec: GrammarSpec) -> Grammar:
    key = (backend.name, spec)
    if key not in _compiled:
        _compiled[key] = backend.compile(spec)
    return _compiled[key]


def dumps(obj, backend: GrammarBackend) -> str:
    """The JSON text the backend's grammar produces: json.dumps' default style for xgrammar and
    llguidance, compact for outlines."""
    if getattr(backend, "json_whitespace", "default") == "compact":
        return json.dumps(obj, separators=(",", ":"))
    return json.dumps(obj)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def allowed_set(m: Matcher) -> set[int]:
    bm = allocate_token_bitmask(1, VOCAB)
    bm.zero_()
    m.fill_mask(bm, 0)
    return set(unpack_bitmask(bm, VOCAB)[0].nonzero().flatten().tolist())


def mask_of(m: Matcher) -> torch.Tensor:
    bm = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    m.fill_mask(bm, 0)
    return bm


def cases(backend: GrammarBackend, tokenizer) -> list[tuple[str, GrammarSpec, str]]:
    out = [
        ("json_schema", GrammarSpec.from_json_schema(PERSON), dumps({"name": "Bob Ray", "age": 42}, backend)),
        ("regex", GrammarSpec.from_regex(r"[0-9]{3}-[a-z]+( ok)?"), "123-abcdef ok"),
        ("choice", GrammarSpec.from_choices(["yes", "no", 'say "hi"\n', "é中"]), 'say "hi"\n'),
    ]
    if backend.name != "outlines":  # outlines: json_object's index takes ~6 s to build; no EBNF
        out.append(("json_object", GrammarSpec.json_object(), dumps({"a": [1, 2.5, None], "b": {"c": "d"}}, backend)))
        out.append(
            (
                "ebnf",
                GrammarSpec.from_ebnf('root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "(" expr ")"'),
                "(1+23)+4",
            )
        )
    return out


# --------------------------------------------------------------------------- tokenizer info


def test_tokenizer_info_bytes(tokenizer):
    info = TokenizerInfo(tokenizer, VOCAB)
    assert info.vocab_size == VOCAB and info.eos_token_ids == (EOS,) and info.vocab_type == "byte_level"
    assert {0, 1, 2, 3, 16} <= info.special_token_ids and 17 not in info.special_token_ids
    text = 'Héllo {"wörld": [1, 2]}\n\t 中文 🎉'
    assert b"".join(info.token_bytes[i] for i in ids_of(tokenizer, text)) == text.encode()
    assert len(_bytes_to_unicode()) == 256
    xgr = pytest.importorskip("xgrammar")
    dv = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB).decoded_vocab
    diff = [i for i in range(VOCAB) if i not in info.special_token_ids and dv[i] != info.token_bytes[i]]
    assert diff == []
    bigger = TokenizerInfo(tokenizer, VOCAB + 40, eos_token_ids=[2, 0])
    assert bigger.eos_token_ids == (2, 0) and bigger.tokenizer_vocab_size == VOCAB


def test_spec_canonical():
    a = GrammarSpec.from_json_schema(
        {
            "type": "object",
            "required": ["b"],
            "properties": {"b": {"type": "string", "maxLength": 3}, "a": {"type": "integer"}},
        }
    )
    b = GrammarSpec.from_json_schema(
        '{"properties": {"b": {"maxLength": 3, "type": "string"}, '
        '"a": {"type": "integer"}}, "type": "object", "required": ["b"]}'
    )
    assert a == b and a.kind == "json_schema"
    assert list(json.loads(a.spec)["properties"]) == ["b", "a"]  # property order is kept
    assert canonical_json({"z": 1, "a": {"y": 2, "b": 3}}) == '{"a":{"b":3,"y":2},"z":1}'
    assert GrammarSpec.json_object() == GrammarSpec("json_object", None)
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        GrammarSpec("yaml", "x")
    with pytest.raises(GrammarError, match="not valid JSON"):
        GrammarSpec.from_json_schema("{nope")
    with pytest.raises(GrammarError, match="list of strings"):
        GrammarSpec("choice", '"abc"').choices()


# --------------------------------------------------------------------------- per backend


def test_valid_strings_walk(backend, tokenizer):
    for kind, spec, text in cases(backend, tokenizer):
        m = compiled(backend, spec).matcher()
        ids = ids_of(tokenizer, text)
        for k, t in enumerate(ids):
            assert not m.is_finished()
            assert m.accept(t), (backend.name, kind, text, k, tokenizer.decode(ids[: k + 1]))
        assert m.num_accepted == len(ids)
        assert m.can_end(), (backend.name, kind)
        if kind in ("json_schema", "choice", "json_object"):
            assert m.is_finished(), (backend.name, kind)  # nothing but EOS may follow
        assert m.accept(EOS) and m.is_finished() and not m.accept(EOS)
        assert m.forced_text() == ""


def test_invalid_rejected_at_the_right_token(backend, tokenizer):
    sep = ":" if backend.name == "outlines" else ": "
    comma = "," if backend.name == "outlines" else ", "
    bad = [  # (spec, the longest valid prefix, the rest, starting with the first invalid character)
        (GrammarSpec.from_json_schema(PERSON), '{"name"' + sep + '"Bob"' + comma + '"age"' + sep, '"x"}'),
        (GrammarSpec.from_json_schema(PERSON), '{"name"' + sep + '"Bob"' + comma + '"ag', 'x"' + sep + "1}"),
        (GrammarSpec.from_json_schema(PERSON), '{"name"' + sep + '"Bob"', "}"),
        (GrammarSpec.from_regex(r"[0-9]{3}-[a-z]+"), "12", "a-bc"),
        (GrammarSpec.from_choices(["yes", "no"]), "yes", "no"),
    ]
    for spec, prefix, rest in bad:
        text, first_bad = prefix + rest, len(prefix)
        m = compiled(backend, spec).matcher()
        ids = ids_of(tokenizer, text)
        ends = [len(tokenizer.decode(ids[: k + 1])) for k in range(len(ids))]
        k_bad = next(k for k, e in enumerate(ends) if e > first_bad)
        for k, t in enumerate(ids[:k_bad]):
            assert m.accept(t), (backend.name, text, k)
        before, forced = mask_of(m), m.forced_text()
        assert not m.accept(ids[k_bad]), (backend.name, text, k_bad)
        assert torch.equal(mask_of(m), before) and m.forced_text() == forced  # state unchanged
        assert m.num_accepted == k_bad
        assert m.accept(EOS) == m.can_end() and not m.accept(1) and not m.accept(VOCAB + 5)


def test_mask_agrees_with_accept(backend, tokenizer):
    gen = torch.Generator().manual_seed(0)
    for kind, spec, text in cases(backend, tokenizer):
        g = compiled(backend, spec)
        ids = ids_of(tokenizer, text)
        for pos in sorted({0, len(ids) // 2, len(ids)}):
            m = g.matcher()
            for t in ids[:pos]:
                assert m.accept(t)
            allowed = allowed_set(m)
            assert allowed, (backend.name, kind, pos)
            assert (EOS in allowed) == m.can_end()
            assert not allowed & {0, 1, 3, 16}  # special tokens never
            sample = set(torch.randint(0, VOCAB, (60,), generator=gen).tolist()) | {EOS, 1, 17}
            al = sorted(allowed)
            sample |= {al[i] for i in torch.randint(0, len(al), (30,), generator=gen).tolist()}
            for t in sorted(sample):
                ok = m.accept(t)
                assert ok == (t in allowed), (backend.name, kind, pos, t, tokenizer.convert_ids_to_tokens(t))
                if ok:
                    m.rollback(1)
            for t in sorted(sample)[:5]:  # and a fresh matcher agrees
                fresh = g.matcher()
                for u in ids[:pos]:
                    fresh.accept(u)
                assert fresh.accept(t) == (t in allowed)


def test_rollback_restores_state(backend, tokenizer):
    spec = GrammarSpec.from_json_schema(PERSON)
    ids = ids_of(tokenizer, dumps({"name": "Ann", "age": 7}, backend))
    m = compiled(backend, spec).matcher()
    snapshots = []
    for t in ids:
        snapshots.append((mask_of(m), m.forced_text(), m.can_end()))
        assert m.accept(t)
    snapshots.append((mask_of(m), m.forced_text(), m.can_end()))
    assert m.accept(EOS) and m.is_finished()
    m.rollback(1)  # un-accept EOS
    assert not m.is_finished() or m.can_end()
    assert torch.equal(mask_of(m), snapshots[-1][0])
    for n in (3, 2, len(ids) - 5):
        m.rollback(n)
        mask, forced, can_end = snapshots[m.num_accepted]
        assert torch.equal(mask_of(m), mask) and m.forced_text() == forced and m.can_end() == can_end
    with pytest.raises(ValueError):
        m.rollback(m.num_accepted + 1)
    for t in ids[m.num_accepted :]:  # and it walks on to the end again
        assert m.accept(t)
    assert m.can_end() and m.accept(EOS)


def test_forced_text(backend, tokenizer):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "kind": {"const": "user"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "kind", "tags"],
        "additionalProperties": False,
    }
    m = compiled(backend, GrammarSpec.from_json_schema(schema)).matcher()
    forced = m.forced_text()
    assert forced.startswith('{"'), (backend.name, forced)
    sep = ":" if backend.name == "outlines" else ": "
    assert forced == '{"name' + '"' + sep + '"', (backend.name, forced)
    for t in ids_of(tokenizer, forced + "Al"):  # accept the forced text (re-tokenized) and go on
        assert m.accept(t)
    assert m.forced_text() == ""  # inside a free string
    for t in ids_of(tokenizer, '"'):
        assert m.accept(t)
    comma = "," if backend.name == "outlines" else ", "
    assert m.forced_text() == comma + '"kind"' + sep + '"user"' + comma + '"tags"' + sep + "["
    m = compiled(backend, GrammarSpec.from_choices(["hello world", "hello there"])).matcher()
    assert m.forced_text() == "hello "
    m = compiled(backend, GrammarSpec.from_regex(r"ab(cd|ce)")).matcher()
    assert m.forced_text() in ("abc", "ab")  # outlines stops at the token boundary


def test_invalid_specs_raise(backend):
    bad = [
        GrammarSpec("json_schema", '{"type": "strin"}'),
        GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'),
        GrammarSpec("json_schema", '{"type": "obj'),
        GrammarSpec("json_schema", '[1, 2]'),
        GrammarSpec("regex", "[a-"),
        GrammarSpec("regex", "(ab"),
        GrammarSpec("choice", '"abc"'),
        GrammarSpec("choice", '[]'),
        GrammarSpec("ebnf", 'root ::= undefined_rule'),
        GrammarSpec("ebnf", 'root ::= "a" ('),
        GrammarSpec("ebnf", 'rot ::= "a"'),
    ]
    for spec in bad:
        with pytest.raises(GrammarError) as e:
            backend.compile(spec)
        assert str(e.value), spec
        if spec.kind == "ebnf" and backend.name == "outlines":
            assert "outlines" in str(e.value) and "EBNF" in str(e.value)


def test_larger_model_vocab(tokenizer, backend):
    big = make_backend(backend.name, tokenizer, VOCAB + 40)
    m = big.compile(GrammarSpec.from_regex("[a-z]+")).matcher()
    bm = allocate_token_bitmask(2, VOCAB + 40)
    m.fill_mask(bm, 1)
    bits = unpack_bitmask(bm, VOCAB + 40)
    assert bits[0].all()  # the other row untouched
    assert not bits[1, VOCAB:].any() and bits[1, :VOCAB].sum() > 1000
    assert not m.accept(VOCAB + 3)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_walks_validate(backend, tokenizer, seed):
    jsonschema = pytest.importorskip("jsonschema")
    schemas = [
        {
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "color": {"enum": ["red", "green", "blue"]},
                "code": {"type": "string", "maxLength": 4},
            },
            "required": ["ok", "color", "code"],
            "additionalProperties": False,
        },
        {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        {
            "type": "object",
            "properties": {"id": {"type": "string", "pattern": "^[a-c]{2}[0-9]$"}, "on": {"type": "null"}},
            "required": ["id"],
            "additionalProperties": False,
        },
    ]
    regexes = [r"[a-z]{1,6}@[a-z]{2,4}\.(com|org)", r"(yes|no|maybe)( [0-9]{1,2})?"]
    gen = torch.Generator().manual_seed(seed)
    bm = allocate_token_bitmask(1, VOCAB)
    specs = [(GrammarSpec.from_json_schema(s), s) for s in schemas] + [(GrammarSpec.from_regex(r), r) for r in regexes]
    for spec, target in specs:
        m = compiled(backend, spec).matcher()
        out: list[int] = []
        while not m.is_finished() and len(out) < 200:
            m.fill_mask(bm, 0)
            allowed = unpack_bitmask(bm, VOCAB)[0].nonzero().flatten()
            assert len(allowed), (backend.name, spec, tokenizer.decode(out))
            t = int(allowed[torch.randint(0, len(allowed), (1,), generator=gen)])
            assert m.accept(t)
            if t == EOS:
                break
            out.append(t)
        assert m.is_finished(), (backend.name, spec, tokenizer.decode(out))
        text = tokenizer.decode(out)
        if isinstance(target, dict):
            jsonschema.validate(json.loads(text), target)
        else:
            assert re.fullmatch(target, text), (backend.name, target, text)


# --------------------------------------------------------------------------- bitmask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_token_bitmask(dtype):
    gen = torch.Generator().manual_seed(0)
    for vocab, logit_width in ((VOCAB, VOCAB), (1000, 1000), (1000, 1030), (1003, 1003)):
        bm = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
        logits = torch.randn(3, logit_width, generator=gen).to(dtype)
        ref = logits.clone()
        allowed = unpack_bitmask(bm, logit_width)
        ref[~allowed] = float("-inf")
        for fn in (apply_token_bitmask_, _apply_torch):
            out = logits.clone()
            fn(out, bm)
            assert torch.equal(out, ref), (fn, vocab, logit_width, dtype)
            assert torch.isinf(out[:, bm.shape[1] * 32 :]).all()  # past the bitmask: never allowed
    with torch.inference_mode():  # as the model's logits are: in-place ops must still work outside
        made = torch.randn(3, VOCAB).to(dtype)
    apply_token_bitmask_(made, torch.zeros(3, VOCAB // 32, dtype=torch.int32))
    assert torch.isinf(made).all()
    one = torch.randn(64)
    mask = torch.tensor([0x0F, 0], dtype=torch.int32)
    apply_token_bitmask_(one, mask)
    assert torch.isfinite(one[:4]).all() and torch.isinf(one[4:]).all()


def test_bitmask_helpers():
    bm = allocate_token_bitmask(2, 70)
    assert bm.shape == (2, 3) and bm.dtype == torch.int32 and (bm == -1).all()
    bm.zero_()
    set_token_bits(bm, 1, [0, 31, 33, 69])
    assert unpack_bitmask(bm, 70)[1].nonzero().flatten().tolist() == [0, 31, 33, 69]
    set_token_bits(bm, 1, [31], value=False)
    assert unpack_bitmask(bm, 70)[1].nonzero().flatten().tolist() == [0, 33, 69]


# --------------------------------------------------------------------------- cache


class _SlowBackend(GrammarBackend):
    name = "slow"

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls: list[tuple[str, str]] = []

    def compile(self, spec, *, timeout_s=None):
        self.calls.append((spec.spec, threading.current_thread().name))
        time.sleep(self.delay)
        if spec.spec == "bad":
            raise GrammarError("slow: bad spec")

        class G(Grammar):
            def matcher(self):
                raise NotImplementedError

        g = G()
        g.spec = spec
        return g


def test_cache_same_object_and_off_thread(tokenizer):
    be = _SlowBackend(0.2)
    cache = GrammarCache(be, compile_timeout_s=5)
    try:
        t0 = time.perf_counter()
        f1 = cache.submit(GrammarSpec.from_regex("a+"))
        f2 = cache.submit(GrammarSpec.from_regex("a+"))
        assert time.perf_counter() - t0 < 0.1 and not f1.done()  # never blocks the caller
        assert f1 is f2 and f1.result(5) is f2.result(5)
        assert cache.get(GrammarSpec.from_regex("a+")) is f1.result()
        assert len(be.calls) == 1 and be.calls[0][1].startswith("plait-grammar")
        with pytest.raises(GrammarError, match="bad spec"):
            cache.get(GrammarSpec.from_regex("bad"), timeout=5)
        assert cache.submit(GrammarSpec.from_regex("bad")).exception() is not None  # cached failure
        assert len(be.calls) == 2 and cache.stats()["hits"] >= 3
    finally:
        cache.shutdown()


def test_cache_timeout_then_late_result():
    be = _SlowBackend(0.6)
    cache = GrammarCache(be, compile_timeout_s=0.2)
    try:
        spec = GrammarSpec.from_regex("b+")
        with pytest.raises(GrammarError, match="compiling took longer than 0.2 s"):
            cache.get(spec, timeout=5)
        time.sleep(0.7)
        assert cache.get(spec, timeout=5).spec == spec  # the late compile replaced the error
    finally:
        cache.shutdown()


def test_cache_real_backend(tokenizer):
    be = make_backend("xgrammar", tokenizer, VOCAB)
    cache = GrammarCache(be)
    try:
        g = cache.get(GrammarSpec.from_json_schema(PERSON), timeout=30)
        assert cache.get(GrammarSpec.from_json_schema(json.dumps(PERSON))) is g
        with pytest.raises(GrammarError, match="xgrammar"):
            cache.get(GrammarSpec.from_regex("[a-"), timeout=30)
    finally:
        cache.shutdown()


def test_auto_backend_routes_and_falls_back(tokenizer):
    """auto: JSON schemas go to llguidance (exact), else xgrammar; a schema llguidance refuses only
    for `oneOf`, keywords it does not implement or a regex it cannot read compiles there with those
    relaxed (`approximate`); one it refuses otherwise falls back to xgrammar; a spec both refuse
    names both reasons."""
    be = make_backend("auto", tokenizer, VOCAB)
    assert be.name == "auto" and set(be.backends) == {"xgrammar", "llguidance"}
    assert be.compile(GrammarSpec.from_json_schema(PERSON)).backend_name == "llguidance"
    assert be.compile(GrammarSpec.from_regex("[0-9]+")).backend_name == "xgrammar"
    assert be.compile(GrammarSpec.from_choices(["yes", "no"])).backend_name == "xgrammar"
    # uniqueItems over objects, overlapping oneOf: llguidance relaxes them (ignored; read as anyOf)
    for approx in (
        {"type": "array", "uniqueItems": True, "items": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"type": "array", "items": {"oneOf": [{"type": "integer"}, {"minimum": 0}]}},
    ):
        g = be.compile(GrammarSpec.from_json_schema(approx))
        assert g.backend_name == "llguidance" and g.approximate
    assert not be.compile(GrammarSpec.from_json_schema(PERSON)).approximate
    # a look-around in a pattern llguidance's regexes cannot read: that entry dropped (approximate)
    approx = {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "patternProperties": {"^(?!a)b$": {"type": "string"}},
        },
    }
    g = be.compile(GrammarSpec.from_json_schema(approx))
    assert g.backend_name == "llguidance" and g.approximate
    m = g.matcher()
    assert all(m.accept(t) for t in ids_of(tokenizer, '[{"a": 1}]')) and m.can_end()
    # a circular $ref beside other keywords: llguidance refuses it outright, xgrammar takes the schema
    refused = {"type": "object", "properties": {"a": {"type": "integer"}, "c": {"$ref": "#", "minProperties": 1}}}
    with pytest.raises(GrammarError, match="circular references with sibling keys"):
        make_backend("llguidance", tokenizer, VOCAB).compile(GrammarSpec.from_json_schema(refused))
    g = be.compile(GrammarSpec.from_json_schema(refused))
    assert g.backend_name == "xgrammar"
    m = g.matcher()
    assert all(m.accept(t) for t in ids_of(tokenizer, '{"a": 1}')) and m.can_end()
    with pytest.raises(GrammarError, match="no grammar backend accepts this spec: xgrammar.*; llguidance"):
        be.compile(GrammarSpec.from_regex("[a-"))


def test_one_of_over_required_keys_is_enforced_exactly(tokenizer):
    """ "Either these keys or those": the rewrite accepts only documents valid under the `oneOf`
    (checked with jsonschema over every subset of keys and a non-object), and llguidance enforces
    it without relaxing anything."""
    import itertools

    import jsonschema

    from plait.grammar.schema_rewrite import exclusive_required

    for branches in (
        [{"required": ["a"]}, {"required": ["b"]}],
        [{"required": ["a", "b"]}, {"required": ["c", "d"]}, {"required": ["e"], "title": "t"}],
        [{"required": ["a"]}, {"required": ["a", "b"]}],
    ):
        one_of, any_of = {"oneOf": branches}, {"anyOf": exclusive_required(branches)}
        keys = sorted({k for b in branches for k in b["required"]})
        docs = [dict.fromkeys(c, 1) for n in range(len(keys) + 1) for c in itertools.combinations(keys, n)]
        accepted = [d for d in docs + [1, "x"] if jsonschema.Draft202012Validator(any_of).is_valid(d)]
        assert accepted and all(jsonschema.Draft202012Validator(one_of).is_valid(d) for d in accepted)
    assert exclusive_required([{"required": ["a"]}, {"type": "string"}]) is None
    # (a $ref followed, properties that allow anything left aside: the test suite's form)
    root = {"$defs": {"two": {"required": ["x"], "properties": {"x": True}}}}
    branches = [{"$ref": "#/$defs/two"}, {"required": ["y"], "properties": {"y": True}}]
    assert exclusive_required(branches, root) == [
        {"type": "object", "required": ["x"], "properties": {"y": False}},
        {"type": "object", "required": ["y"], "properties": {"x": False}},
    ]
    assert (
        exclusive_required([{"required": ["y"], "properties": {"y": {"type": "string"}}}, {"required": ["z"]}]) is None
    )
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
    }
    g = make_backend("auto", tokenizer, VOCAB).compile(GrammarSpec.from_json_schema(schema))
    assert g.backend_name == "llguidance" and not g.approximate
    for text, ok in (('{"a": 1}', True), ('{"b": 2}', True), ('{"a": 1, "b": 2}', False), ("{}", False)):
        m = g.matcher()
        assert (all(m.accept(t) for t in ids_of(tokenizer, text)) and m.can_end()) == ok, text


ELM_LIKE = {  # an if/then/else chain keyed on one property (JSONSchemaBench's elm.json)
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["application", "package"]}},
    "if": {"properties": {"type": {"enum": ["package"]}}},
    "then": {"$ref": "#/definitions/package"},
    "else": {
        "if": {"properties": {"type": {"const": "application"}}},
        "then": {"required": ["dirs"], "properties": {"dirs": {"type": "array"}}},
    },
    "definitions": {"package": {"properties": {"name": {"type": "string"}}, "required": ["name"]}},
}
SAUCE_LIKE = {  # allOf of bare if/then keyed on two properties, a then with $refs into itself (saucectl)
    "type": "object",
    "properties": {"kind": {"enum": ["a", "b", "c"]}, "v": {}},
    "allOf": [
        {
            "if": {"properties": {"kind": {"const": "a"}, "v": {"const": 1}}},
            "then": {
                "required": ["x"],
                "properties": {"x": {"$ref": "#/allOf/0/then/definitions/n"}},
                "definitions": {"n": {"type": "integer"}},
            },
        },
        {"if": {"properties": {"kind": {"const": "a"}, "v": {"const": 2}}}, "then": {"required": ["y"]}},
        {"if": {"properties": {"kind": {"const": "b"}}}, "then": {"required": ["z"]}},
    ],
}


@pytest.mark.parametrize("schema", [ELM_LIKE, SAUCE_LIKE], ids=["chain", "all_of"])
def test_conditionals_become_exact_branches(tokenizer, schema):
    """if/then/else keyed on property values: every document the rewrite accepts is valid under
    the original (jsonschema, over combinations of keys and values), documents for each case are
    accepted, and llguidance compiles the rewrite without relaxing anything."""
    import itertools

    import jsonschema

    from plait.grammar.schema_rewrite import conditional_branches

    rewritten = conditional_branches(schema)
    assert rewritten is not None and "if" not in json.dumps(rewritten)
    values = {
        "type": ["application", "package", "other"],
        "kind": ["a", "b", "c"],
        "v": [1, 2],
        "name": ["n"],
        "dirs": [[]],
        "x": [1, "s"],
        "y": [1],
        "z": [1],
    }
    keys = [k for k in values if k in json.dumps(schema)]
    docs = []
    for n in range(len(keys) + 1):
        for chosen in itertools.combinations(keys, n):
            docs += [dict(zip(chosen, vals)) for vals in itertools.product(*(values[k] for k in chosen))]
    original, rewrite = jsonschema.Draft7Validator(schema), jsonschema.Draft7Validator(rewritten)
    accepted = [d for d in docs if rewrite.is_valid(d)]
    assert all(original.is_valid(d) for d in accepted)
    assert len(accepted) >= 4
    g = make_backend("auto", tokenizer, VOCAB).compile(GrammarSpec.from_json_schema(schema))
    assert g.backend_name == "llguidance" and not g.approximate
    good, bad = (
        (
            ['{"type": "package", "name": "n"}', '{"type": "application", "dirs": []}'],
            ['{"type": "package", "dirs": []}', '{"type": "application", "name": "n"}'],
        )
        if schema is ELM_LIKE
        else (
            ['{"kind": "a", "v": 1, "x": 3}', '{"kind": "b", "z": 1}'],
            ['{"kind": "a", "v": 1, "x": "s"}', '{"kind": "b", "y": 1}'],
        )
    )
    for text, ok in [(t, True) for t in good] + [(t, False) for t in bad]:
        m = g.matcher()
        assert (all(m.accept(t) for t in ids_of(tokenizer, text)) and m.can_end()) == ok, text


ABSENT_LIKE = {  # not-required inside oneOf, dependencies of both kinds (JSONSchemaBench's o90940)
    "type": "object",
    "properties": {"kind": {"enum": ["p", "q"]}, "a": {}, "b": {}, "c": {}, "d": {}},
    "oneOf": [{"required": ["a", "b"]}, {"allOf": [{"not": {"required": ["b"]}}, {"required": ["c"]}]}],
    "dependencies": {"a": {"properties": {"kind": {"const": "p"}}}, "d": ["c"]},
}


def test_keys_kept_out_are_enforced_exactly(tokenizer):
    """`not: {required}`, `not: {}` and `dependencies` become forbidden keys or dependencies applied
    where their key is required: the rewrite accepts only valid documents and llguidance compiles
    it without relaxing anything (it had ignored them, leaving the output check to withhold)."""
    import itertools

    import jsonschema

    from plait.grammar.schema_rewrite import strict_schema

    rewritten = strict_schema(ABSENT_LIKE, close=False)
    assert "not" not in json.dumps(rewritten) and "dependencies" not in rewritten
    assert strict_schema({"properties": {"x": {"not": {}}}})["properties"]["x"] is False
    values = {"kind": ["p", "q"], "a": [1], "b": [1], "c": [1], "d": [1]}
    docs = [
        dict(zip(chosen, vals))
        for n in range(6)
        for chosen in itertools.combinations(values, n)
        for vals in itertools.product(*(values[k] for k in chosen))
    ]
    original, rewrite = jsonschema.Draft7Validator(ABSENT_LIKE), jsonschema.Draft7Validator(rewritten)
    accepted = [d for d in docs if rewrite.is_valid(d)]
    assert len(accepted) >= 4 and all(original.is_valid(d) for d in accepted)
    g = make_backend("auto", tokenizer, VOCAB).compile(GrammarSpec.from_json_schema(ABSENT_LIKE))
    assert g.backend_name == "llguidance" and not g.approximate
    for text, ok in (
        ('{"kind": "p", "a": 1, "b": 2}', True),
        ('{"kind": "q", "a": 1, "b": 2}', False),
        ('{"c": 1}', True),
        ('{"b": 1, "c": 1}', False),
        ('{"c": 1, "d": 1}', False),
    ):
        m = g.matcher()
        assert (all(m.accept(t) for t in ids_of(tokenizer, text)) and m.can_end()) == ok, text


def test_strict_mode_forbids_undeclared_keys(tokenizer):
    """xgrammar, llguidance and auto close objects that declare properties (strict mode, the
    default) so the model stops after the declared keys; strict_mode=False follows JSON Schema."""
    from plait.grammar.schema_rewrite import strict_schema

    nested = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "c": {"enum": [{"properties": 1}]},
        },
        "allOf": [{"properties": {"x": {}}}],
        "$defs": {"d": {"properties": {"e": {}}}},
    }
    s = strict_schema(nested)
    assert "additionalProperties" not in s  # has allOf: its branches add keys
    assert s["properties"]["a"]["additionalProperties"] is False
    assert s["properties"]["c"] == {"enum": [{"properties": 1}]}  # data, not a schema
    assert "additionalProperties" not in s["allOf"][0]
    assert s["$defs"]["d"]["additionalProperties"] is False
    # a required key the properties do not declare: left open, or no document could satisfy it
    assert "additionalProperties" not in strict_schema({"properties": {"a": {}}, "required": ["a", "text"]})
    extra = ids_of(tokenizer, '{"name": "a", "age": 1, "x": 2}')
    for name in ("xgrammar", "llguidance", "auto"):
        for strict in (True, False):
            m = (
                make_backend(name, tokenizer, VOCAB, strict_mode=strict)
                .compile(GrammarSpec.from_json_schema(PERSON))
                .matcher()
            )
            walked = all(m.accept(t) for t in extra) and m.can_end()
            assert walked is (not strict), (name, strict)


def test_auto_backend_without_llguidance(tokenizer, monkeypatch):
    import plait.grammar as pg

    monkeypatch.setattr(pg, "available_backends", lambda: ["xgrammar", "outlines"])
    be = make_backend("auto", tokenizer, VOCAB)
    assert set(be.backends) == {"xgrammar"}
    assert be.compile(GrammarSpec.from_json_schema(PERSON)).backend_name == "xgrammar"
    with pytest.raises(GrammarError, match="^xgrammar"):
        be.compile(GrammarSpec.from_regex("[a-"))


def test_make_backend_errors(tokenizer, monkeypatch):
    import plait.grammar as pg

    with pytest.raises(ValueError, match="unknown grammar backend"):
        make_backend("nope", tokenizer, VOCAB)
    monkeypatch.setitem(pg.BACKENDS, "missing", (".no_such_backend_module", "X", "the-missing-package"))
    with pytest.raises(ImportError, match="'missing' is not available: it needs the-missing-package"):
        make_backend("missing", tokenizer, VOCAB)
    assert "missing" not in pg.available_backends()


# --------------------------------------------------------------------------- outlines guard

# a realistic 16-property schema whose outlines-core Index grows past 1 GB (it used > 20 GB)
BLOWUP = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string", "format": "email"},
        "age": {"type": "integer", "minimum": 0},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "created": {"type": "string", "format": "date-time"},
        "url": {"type": "string", "format": "uri"},
        "status": {"type": "string", "enum": ["a", "b", "c"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
        },
        "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
        "notes": {"type": "string", "maxLength": 200},
        "rating": {"type": "number"},
        "uuid": {"type": "string", "format": "uuid"},
        "count": {"type": "integer"},
    },
}


def test_outlines_blowup_guard(tokenizer):
    pytest.importorskip("outlines_core")
    be = make_backend("outlines", tokenizer, VOCAB, max_memory_mb=64)
    t0 = time.perf_counter()
    with pytest.raises(GrammarError, match="memory limit of 64 MiB"):
        be.compile(GrammarSpec.from_json_schema(BLOWUP))
    assert time.perf_counter() - t0 < 60  # bounded (the child's start-up is slow on a loaded machine)
    be2 = make_backend("outlines", tokenizer, VOCAB, max_memory_mb=4096, compile_timeout_s=0.5)
    cache = GrammarCache(be2, compile_timeout_s=10)
    try:
        t0 = time.perf_counter()
        with pytest.raises(GrammarError, match="compiling took longer than 0.5 s"):
            cache.get(GrammarSpec.from_json_schema(BLOWUP), timeout=30)
        assert time.perf_counter() - t0 < 5
        # the backend still works afterwards
        assert cache.get(GrammarSpec.from_regex("[0-9]+"), timeout=30).matcher().accept(ids_of(tokenizer, "42")[0])
    finally:
        cache.shutdown()


def test_strict_mode_leaves_parts_of_an_object_open(tokenizer):
    """An object that is only a part of one (an allOf branch, a conditional's then / else, the
    branches of an object that declares keys, a definition those refer to) is left open: closing it
    forbids what the other parts declare (dependabot's schema: `version` unsatisfiable)."""
    from plait.grammar.schema_rewrite import strict_schema

    schema = {  # the shape of SchemaStore's dependabot-2.0 schema
        "type": "object",
        "required": ["version", "updates"],
        "properties": {
            "version": {"const": 2},
            "updates": {"type": "array", "items": {"$ref": "#/definitions/update"}},
        },
        "definitions": {
            "update": {"type": "object", "properties": {"ecosystem": {"type": "string"}, "dir": {"type": "string"}}},
            "part": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
        "allOf": [
            {
                "if": {"required": ["beta"]},
                "then": {},
                "else": {"properties": {"updates": {"items": {"properties": {"ecosystem": {"enum": ["npm"]}}}}}},
            },
            {"anyOf": [{"$ref": "#/definitions/part"}, {"required": ["version"]}]},
        ],
    }
    s = strict_schema(schema)
    else_ = s["allOf"][0]["anyOf"][1]  # (an `if` on a key's presence: the anyOf of its two cases)
    assert "additionalProperties" not in else_ and "additionalProperties" not in else_["properties"]["updates"]["items"]
    assert "additionalProperties" not in s["definitions"]["part"]  # referred to from an allOf branch
    assert s["definitions"]["update"]["additionalProperties"] is False  # a whole object: closed
    doc = {"version": 2, "updates": [{"ecosystem": "npm", "dir": "/"}]}
    grammar = make_backend("llguidance", tokenizer, VOCAB).compile(GrammarSpec.from_json_schema(schema))
    m = grammar.matcher()
    assert all(m.accept(t) for t in ids_of(tokenizer, json.dumps(doc))) and m.can_end()
