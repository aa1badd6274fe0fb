"""`fill_masks` (grammar/base.py): a batch's masks with llguidance's rows computed together on its
thread pool. Every row must equal what the matcher's own `fill_mask` writes, whatever the mix:
guarded JSON near its end (the guard walks after the batched fill), xgrammar rows, a finished
matcher, reasoning gates with the section open and closed, regexes; and no matcher's state moves."""

from __future__ import annotations

import pytest
import torch

from plait.grammar import GrammarSpec, allocate_token_bitmask, make_backend, tokenizer_info
from plait.grammar.base import fill_masks
from plait.grammar.json_guard import JsonLimits, guarded
from plait.grammar.reasoning_gate import ReasoningGate

VOCAB = 49152
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}, "tags": {"type": "array"}},
    "required": ["name", "n"],
}


@pytest.fixture(scope="module")
def info(smollm2_tokenizer):
    return tokenizer_info(smollm2_tokenizer, VOCAB, [EOS])


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _batch(tokenizer, info) -> list:
    """Matchers in assorted states, built afresh each call (the same tokens every time)."""
    backends = {name: make_backend(name, info) for name in ("llguidance", "xgrammar")}
    json_spec = GrammarSpec.from_json_schema(SCHEMA)
    out = []
    for name, b in backends.items():
        g = b.compile(json_spec)
        for prefix, budget in (("", 200), ('{"name": "ab', 200), ('{"name": "abc", "n": 12', 14)):
            m = guarded(g.matcher(), json_spec, info, JsonLimits(), budget)  # budget 14: closing
            for t in _ids(tokenizer, prefix):
                assert m.accept(t)
            out.append(m)
        regex = b.compile(GrammarSpec.from_regex("[a-z]+ [0-9]{2}"))
        done = regex.matcher()
        for t in [*_ids(tokenizer, "ab 12"), EOS]:
            assert done.accept(t)
        out.append(done)
        out.append(regex.matcher())
    g = backends["llguidance"].compile(json_spec)
    end = _ids(tokenizer, "</think>")
    open_gate = ReasoningGate(lambda k: guarded(g.matcher(), json_spec, info, JsonLimits(), k), end, [EOS], 100)
    closed_gate = ReasoningGate(lambda k: guarded(g.matcher(), json_spec, info, JsonLimits(), k), end, [EOS], 100)
    for t in [*_ids(tokenizer, "Hm."), *end, *_ids(tokenizer, '{"na')]:
        assert closed_gate.accept(t)
    undecided = ReasoningGate(lambda k: g.matcher(), end, [EOS], 100, start_id=_ids(tokenizer, "<think>")[0])
    return [*out, open_gate, closed_gate, undecided]


def test_batched_masks_equal_each_matchers_own(smollm2_tokenizer, info):
    one_by_one = _batch(smollm2_tokenizer, info)
    want = allocate_token_bitmask(len(one_by_one), VOCAB)
    want.zero_()
    for j, m in enumerate(one_by_one):
        m.fill_mask(want, j)
    batched = _batch(smollm2_tokenizer, info)
    got = allocate_token_bitmask(len(batched), VOCAB)
    got.zero_()
    accepted = [m.num_accepted for m in batched]
    fill_masks(batched, got)
    for j in range(len(batched)):
        assert torch.equal(got[j], want[j]), f"row {j} ({type(batched[j]).__name__}) differs"
    assert [m.num_accepted for m in batched] == accepted
    assert any(getattr(m, "_closing_now", False) for m in batched)  # (a guard walked to its close)
    assert all(bool(got[j].any()) for j in range(len(batched)))
