"""weight_arena: a model's weights moved into one huge-page buffer are all there, stay tied where
they were tied, and compute bit for bit what they computed before."""

from __future__ import annotations

import pytest
import torch
from test_model import Harness

from plait.runtime.kernels.cpu import cpu_kernels
from plait.runtime.model_executor import weight_arena


def _inside(arena: torch.Tensor, t: torch.Tensor) -> bool:
    start = arena.data_ptr()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + arena.numel()


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_consolidated_model_computes_the_same(tiny_model_dirs, monkeypatch, quantization):
    path = tiny_model_dirs["llama"]  # a tied LM head
    monkeypatch.setattr(weight_arena, "MIN_BYTES", 0)  # every tensor, not only a real model's large ones
    moved = Harness(path, prepack=True, quantization=quantization)
    arena = moved.runner.weight_arena
    if arena is None:
        pytest.skip("the kernel refused MADV_HUGEPAGE (transparent huge pages off)")
    assert arena.data_ptr() % weight_arena.HUGE_PAGE == 0
    model = moved.runner.model
    for name, p in model.named_parameters():
        assert _inside(arena, p), name
    plan = model._decode_plan(1, torch.float32)  # what a batch-1 decode step streams
    if cpu_kernels.small_gemm_available(torch.float32):  # the fused decode op runs here
        assert plan is not None and all(_inside(arena, t) for t in plan[0] if t.numel())
    if quantization is None:
        assert model.lm_head.local_weight() is model.embed_tokens.weight  # still tied
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in {p.data_ptr(): p for p in model.parameters()}.values()
    )
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two tensors overlap

    monkeypatch.setattr(weight_arena, "consolidate", lambda m: None)
    plain = Harness(path, prepack=True, quantization=quantization)
    assert plain.runner.weight_arena is None
    ids = list(range(100, 140))
    r_moved, r_plain = moved.new_row(), plain.new_row()
    assert torch.equal(moved.step([(r_moved, ids)])[0], plain.step([(r_plain, ids)])[0])
    for tok in (7, 8, 9):  # decode steps (the fused decode path's plans are rebuilt on the moved tensors)
        assert torch.equal(moved.step([(r_moved, [tok])])[0], plain.step([(r_plain, [tok])])[0])


def test_nothing_to_move_returns_none():
    assert weight_arena.consolidate(torch.nn.Linear(4, 4)) is None  # below MIN_BYTES
