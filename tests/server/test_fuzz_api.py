"""Fuzzing: schemathesis against a live tiny-model server (from its own /openapi.json), and
hypothesis properties of the pieces under it — the detokenizer (any bytes, any split), the KV
slot allocator and request table (never a slot handed out twice, all of them returned), and the
grammar matchers (what they accept fullmatches the regex / validates against the schema).
The radix cache has its own stateful test in test_radix_cache.py."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
from conftest import serve
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import plait
from plait.runtime.mem_cache.memory_pool import ReqToTokenTable, TokenSlotAllocator
from plait.runtime.server.http_server import create_app

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402  (after importorskip)
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

FUZZ_EXAMPLES = 10  # per operation and mode: ~1-2 minutes in all on a loaded 2-core machine


# --- schemathesis against a live server ---------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    with plait.Engine(
        model=tiny_model_dirs["llama"], dtype="float32", max_total_tokens=4096, chunked_prefill_size=256, random_seed=0
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def base_url(engine):
    # a small time limit: fuzzed requests may ask for many long sequences
    with serve(create_app(engine, served_model_name="tiny", request_timeout=5.0)) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(base_url):
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    # /abort_request {abort_all} would abort other cases; /health_generate is a plain generate
    return schema.exclude(path_regex="^/(abort_request|health_generate)$")


def no_server_error(ctx, response, case) -> None:
    """not_a_server_error, except 504: the server's own --request-timeout answer to a fuzzed
    request that asks for a long generation is the designed outcome, not a crash."""
    if response.status_code != 504:
        return not_a_server_error(ctx, response, case)
    assert response.json()["error"]["code"] == "request_timeout"
    return None


CHECKS = [
    no_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


def test_api_fuzz(api_schema):
    """Every operation, with data that fits the published schema and data that does not: no 5xx,
    only documented statuses and content types, bodies match the schema, and whatever the schema
    forbids is rejected (4xx). Failures of all operations are collected, then reported together."""
    failures: list[str] = []
    ran = 0
    for result in api_schema.get_all_operations():
        op = result.ok()
        has_input = bool(op.body) or any(True for _ in op.iter_parameters())
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[: 1 + has_input]:
            calls = []

            @settings(
                max_examples=FUZZ_EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case) -> None:
                calls.append(1)
                case.call_and_validate(checks=CHECKS, timeout=60)

            try:
                run()
            except BaseException as e:  # schemathesis' FailureGroup is a BaseExceptionGroup: collected
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                failures.append(f"{op.method.upper()} {op.path} [{mode.value}]: {str(e)[:1500]}")
            ran += len(calls)
    assert ran > 50
    assert not failures, "\n\n".join(failures)


def test_server_answers_after_fuzzing(base_url, engine):
    """Runs after the fuzz test (file order): the server still generates and nothing leaked."""
    out = httpx.post(
        base_url + "/generate",
        json={"text": "after", "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
        timeout=60,
    )
    assert out.status_code == 200 and len(out.json()["output_ids"]) == 4
    import time

    deadline = time.monotonic() + 10
    while engine.kv_slots_in_use():
        assert time.monotonic() < deadline, "KV slots leaked by fuzzed requests"
        time.sleep(0.1)


# --- the detokenizer ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from plait.runtime.model_executor.model_loader import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def byte_ids(tokenizer) -> dict[int, int]:
    """byte -> the token of that single byte (byte-level BPE), for every byte the vocabulary has
    (all but a few never used in UTF-8), so a byte string is a token sequence."""
    from plait.grammar.tokenizer_info import _bytes_to_unicode

    table = _bytes_to_unicode()
    out = {b: tokenizer.convert_tokens_to_ids(table[b]) for b in range(256)}
    out = {b: i for b, i in out.items() if tokenizer.convert_ids_to_tokens(i) == table[b]}
    assert len(out) > 200 and all(b in out for b in "é😀日".encode())
    return out


def _splits(n: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(1, max(n, 1)), min_size=0, max_size=n)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_detokenizer_any_bytes_any_split(tokenizer, byte_ids, data):
    from plait.runtime.managers.detokenizer import IncrementalDetokenizer

    raw = data.draw(
        st.lists(st.sampled_from(sorted(byte_ids)), max_size=40).map(bytes)
        | st.text(max_size=15).map(lambda s: s.encode()).filter(lambda b: all(x in byte_ids for x in b)),
        label="bytes",
    )
    ids = [byte_ids[b] for b in raw]
    # mix in ordinary multi-byte tokens too
    extra = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=6), label="tokens")
    for pos, tok in zip(data.draw(st.lists(st.integers(0, len(ids)), min_size=len(extra), max_size=len(extra))), extra):
        if tok not in tokenizer.all_special_ids:
            ids.insert(pos, tok)
    detok = IncrementalDetokenizer(tokenizer)
    cuts = data.draw(_splits(len(ids)), label="chunk sizes")
    pos, text = 0, ""
    for size in cuts:
        chunk = ids[pos : pos + size]
        pos += len(chunk)
        delta = detok.add(chunk)
        assert not delta.endswith("\ufffd")  # half a character is held back, never sent
        text += delta
    text += detok.add(ids[pos:], final=True)
    assert text == detok.text == tokenizer.decode(ids, skip_special_tokens=True)


# --- the KV slot allocator and the request table --------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    num_slots=st.integers(1, 64),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 70)), max_size=60),
    data=st.data(),
)
def test_allocator_never_hands_out_a_slot_twice(num_slots, ops, data):
    alloc = TokenSlotAllocator(num_slots)
    held: list[torch.Tensor] = []
    out: set[int] = set()
    for is_alloc, n in ops:
        if is_alloc:
            got = alloc.alloc(n)
            if n > num_slots - len(out):
                assert got is None
                continue
            assert got is not None and got.numel() == n and got.dtype == torch.int64
            ids = set(got.tolist())
            assert len(ids) == n and not ids & out and 0 not in ids and ids <= set(range(1, num_slots + 1))
            out |= ids
            held.append(got)
        elif held:
            i = data.draw(st.integers(0, len(held) - 1))
            block = held.pop(i)
            alloc.free(block)
            out -= set(block.tolist())
        assert alloc.available() == num_slots - len(out)
    for block in held:
        alloc.free(block)
    assert alloc.available() == num_slots
    everything = alloc.alloc(num_slots)
    assert sorted(everything.tolist()) == list(range(1, num_slots + 1))


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 16), ops=st.lists(st.booleans(), max_size=50), data=st.data())
def test_request_table_rows_unique(rows, ops, data):
    table = ReqToTokenTable(rows, 4)
    held: list[int] = []
    for take in ops:
        if take:
            r = table.alloc()
            if len(held) == rows:
                assert r is None
            else:
                assert r is not None and r not in held and 0 <= r < rows
                held.append(r)
        elif held:
            table.free(held.pop(data.draw(st.integers(0, len(held) - 1))))
        assert table.available() == rows - len(held)


# --- the grammar matchers ---------------------------------------------------------------------------
VOCAB = 49152
REGEXES = [r"[a-z]{1,5}@[a-z]{2,4}\.(com|org)", r"(yes|no)( [0-9]{1,3})?", r"-?[0-9]{1,4}(\.[0-9]{1,2})?"]
SCHEMAS = [
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}, "tag": {"enum": ["a", "b"]}},
        "required": ["ok", "n", "tag"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
]


@pytest.fixture(scope="module")
def grammars(tokenizer):
    """(backend, kind, key) -> compiled grammar, for xgrammar (regexes, json_object) and llguidance
    (the default for JSON schemas), each on every spec."""
    from plait.grammar import GrammarSpec, make_backend

    out = {}
    for name in ("xgrammar", "llguidance"):
        backend = make_backend(name, tokenizer, VOCAB)
        out.update({(name, "regex", r): backend.compile(GrammarSpec.from_regex(r)) for r in REGEXES})
        out.update(
            {(name, "schema", i): backend.compile(GrammarSpec.from_json_schema(s)) for i, s in enumerate(SCHEMAS)}
        )
    return out


XGRAMMAR_CONTROL_CHARS = pytest.mark.xfail(
    reason="xgrammar's JSON string rule lets raw control characters (U+0000-U+001F) through: '[\"\\x00!\"]' "
    "is accepted, and is not JSON (see test_xgrammar_json_strings_reject_control_characters)"
)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_regex_matcher_accepts_exactly_matching_text(tokenizer, grammars, backend, data):
    """A string that fullmatches is accepted token by token and can end; a walk through tokens the
    mask allows always ends in a string that fullmatches."""
    from plait.grammar import allocate_token_bitmask
    from plait.grammar.bitmask import unpack_bitmask

    pattern = data.draw(st.sampled_from(REGEXES))
    grammar = grammars[(backend, "regex", pattern)]
    text = data.draw(st.from_regex(pattern, fullmatch=True).filter(lambda s: s.isascii()))
    m = grammar.matcher()
    for t in tokenizer.encode(text, add_special_tokens=False):
        assert m.accept(t), (pattern, text)
    assert m.can_end()
    m = grammar.matcher()
    bm = allocate_token_bitmask(1, VOCAB)
    out: list[int] = []
    while len(out) < 64:
        m.fill_mask(bm, 0)
        allowed = unpack_bitmask(bm, VOCAB)[0].nonzero().flatten().tolist()
        t = data.draw(st.sampled_from(allowed))
        assert m.accept(t)
        if t not in tokenizer.all_special_ids:  # EOS ends the walk without being text
            out.append(t)
        if m.is_finished():
            break
    assert m.is_finished(), (pattern, tokenizer.decode(out))  # the patterns are bounded
    text = tokenizer.decode([t for t in out if t not in tokenizer.all_special_ids])
    assert re.fullmatch(pattern, text), (pattern, text)


@pytest.mark.parametrize("backend", [pytest.param("xgrammar", marks=XGRAMMAR_CONTROL_CHARS), "llguidance"])
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_schema_matcher_outputs_validate(tokenizer, grammars, backend, data):
    jsonschema = pytest.importorskip("jsonschema")
    from plait.grammar import allocate_token_bitmask
    from plait.grammar.bitmask import unpack_bitmask

    i = data.draw(st.integers(0, len(SCHEMAS) - 1))
    m = grammars[(backend, "schema", i)].matcher()
    bm = allocate_token_bitmask(1, VOCAB)
    out: list[int] = []
    while not m.is_finished() and len(out) < 120:
        m.fill_mask(bm, 0)
        allowed = unpack_bitmask(bm, VOCAB)[0].nonzero().flatten().tolist()
        t = data.draw(st.sampled_from(allowed))
        assert m.accept(t)
        if t not in tokenizer.all_special_ids:
            out.append(t)
    if not m.is_finished():
        return  # a walk that never closed within the budget says nothing about validity
    text = tokenizer.decode([t for t in out if t not in tokenizer.all_special_ids])
    jsonschema.validate(json.loads(text), SCHEMAS[i])


@pytest.mark.xfail(
    strict=True,
    reason="xgrammar accepts a raw control character inside a JSON string "
    "(found by test_schema_matcher_outputs_validate); json_object output can be invalid JSON",
)
def test_xgrammar_json_strings_reject_control_characters(tokenizer, grammars):
    nul = tokenizer.convert_tokens_to_ids("\u0100")  # byte-level BPE's token for the byte 0x00
    assert tokenizer.decode([nul]) == "\x00"
    m = grammars[("xgrammar", "schema", 1)].matcher()  # an array of strings
    for t in tokenizer.encode('["', add_special_tokens=False):
        assert m.accept(t)
    assert not m.accept(nul)
