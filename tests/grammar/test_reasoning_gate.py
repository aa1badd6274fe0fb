"""The reasoning gate (grammar/reasoning_gate.py): a constraint that binds only after `</think>`.
Its masks are checked against the inner matcher's own, through section, marker, answer and
rollbacks across each boundary, on a real JSON-schema grammar and the real tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from plait.grammar import GrammarSpec, allocate_token_bitmask, make_backend, tokenizer_info
from plait.grammar.reasoning_gate import ReasoningGate

VOCAB = 49152
EOS = 2
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def grammar(tokenizer):
    info = tokenizer_info(tokenizer, VOCAB, [EOS])
    return make_backend("auto", info).compile(GrammarSpec.from_json_schema(json.dumps(SCHEMA)))


def _mask(m) -> torch.Tensor:
    bm = allocate_token_bitmask(1, VOCAB)
    bm.zero_()
    m.fill_mask(bm, 0)
    return bm[0].clone()


def _allowed(mask: torch.Tensor, tok: int) -> bool:
    return bool((int(mask[tok >> 5]) >> (tok & 31)) & 1)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_open_section_is_free_then_the_grammar_binds(tokenizer, grammar):
    budgets = []

    def make(budget):
        budgets.append(budget)
        return grammar.matcher()

    end = _ids(tokenizer, "</think>")
    gate = ReasoningGate(make, end, [EOS], budget=100)
    fresh = _mask(grammar.matcher())
    for tok in _ids(tokenizer, "Let me see: 2 + 2 is four.") + end:
        mask = _mask(gate)
        assert _allowed(mask, tok) and not _allowed(mask, EOS)  # free text, but the answer must come
        assert not gate.accept(EOS) and gate.accept(tok)
    assert torch.equal(_mask(gate), fresh)  # the grammar's own start
    thought = gate.num_accepted
    assert budgets == [100 - thought]  # what the section left of max_new_tokens
    doc = _ids(tokenizer, '{"a": 4}')
    for tok in doc:
        assert gate.accept(tok)
    assert gate.accept(EOS) and gate.is_finished() and gate.num_accepted == thought + len(doc) + 1
    assert not gate.accept(_ids(tokenizer, "x")[0])

    gate.rollback(len(doc) + 1)  # back to just after the marker: the grammar's start again
    assert torch.equal(_mask(gate), fresh) and not gate.can_end()
    gate.rollback(1)  # into the marker: free text again
    assert _allowed(_mask(gate), _ids(tokenizer, " hello")[0]) and gate.num_accepted == thought - 1
    assert gate.accept(end[-1]) and torch.equal(_mask(gate), fresh)


def test_optional_section_answer_straight_away(tokenizer, grammar):
    start = _ids(tokenizer, "<think>")[0]
    gate = ReasoningGate(lambda b: grammar.matcher(), _ids(tokenizer, "</think>"), [EOS], 50, start_id=start)
    mask, fresh = _mask(gate), _mask(grammar.matcher())
    assert _allowed(mask, start) and not _allowed(fresh, start)
    other = fresh.clone()
    other[start >> 5] = mask[start >> 5]
    assert torch.equal(mask, other)  # the grammar's first mask plus the marker's first token
    brace = _ids(tokenizer, "{")[0]
    assert not gate.accept(_ids(tokenizer, "Hi")[0])  # neither the marker nor the answer
    assert gate.accept(brace)  # the answer, at once under the grammar
    assert not _allowed(_mask(gate), start)
    gate.rollback(1)
    assert torch.equal(_mask(gate), mask)


def test_optional_section_taken(tokenizer, grammar):
    think = _ids(tokenizer, "<think>")
    end = _ids(tokenizer, "</think>")
    gate = ReasoningGate(lambda b: grammar.matcher(), end, [EOS], 50, start_id=think[0])
    for tok in think + _ids(tokenizer, " hmm ") + end:
        assert gate.accept(tok)
    assert torch.equal(_mask(gate), _mask(grammar.matcher()))
    gate.rollback(gate.num_accepted - 1)  # just the marker's first token: inside the section
    assert _allowed(_mask(gate), _ids(tokenizer, "Hi")[0])
    gate.rollback(1)  # nothing written: undecided again
    assert _allowed(_mask(gate), think[0]) and not _allowed(_mask(gate), _ids(tokenizer, "Hi")[0])
    with pytest.raises(ValueError):
        gate.rollback(1)
