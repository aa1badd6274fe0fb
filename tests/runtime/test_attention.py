"""Attention backends against a plain reference (per request: SDPA over the K/V gathered from the
pool through the request-to-token table, causal from its prefix), over multi-step scenarios:
mixed extend/decode groups, shared prefixes, membership changes, a request that skips a step,
rejected drafts, a rewritten table row, and a row reused by a new request on recycled slots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.runtime.kernels.cpu import cpu_kernels
from plait.runtime.mem_cache.memory_pool import KVPool, ReqToTokenTable, TokenSlotAllocator
from plait.runtime.model_executor import weight_arena
from plait.runtime.model_executor.attention import MirroredAttention, TorchNativeAttention
from plait.runtime.model_executor.forward_batch import ForwardBatch

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 8
SCALE = HEAD_DIM**-0.5


@pytest.fixture(autouse=True, params=["fused kernels", "eager ops"])
def kernels(request, monkeypatch):
    """Every scenario twice: decode rows through the fused decode-attention kernel and through SDPA."""
    monkeypatch.setitem(cpu_kernels._state, "ok", request.param == "fused kernels" and cpu_kernels.load())


@pytest.fixture(autouse=True, params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def model_dtype(request, monkeypatch):
    """Every scenario for a float32 model and a bfloat16 one (its pool in bfloat16: SDPA widens it)."""
    monkeypatch.setattr(Sim, "dtype", request.param)


class Sim:
    """A pool, a table and requests (row -> tokens in KV); steps run the backend layer by layer."""

    dtype = torch.float32  # the model's, and the pool's

    def __init__(self, backend_cls, slots: int = 4096, **kw):
        self.pool = KVPool(slots, LAYERS, KV_HEADS, HEAD_DIM, self.dtype)
        self.alloc = TokenSlotAllocator(slots)
        self.table = ReqToTokenTable(16, 1024)
        self.backend = backend_cls(self.pool, **kw)
        self.kv_len: dict[int, int] = {}
        self.gen = torch.Generator().manual_seed(0)

    def new(self, prefix_of: int | None = None, shared: int = 0) -> int:
        row = self.table.alloc()
        self.kv_len[row] = 0
        if prefix_of is not None:  # share the first `shared` slots of another request
            self.table.table[row, :shared] = self.table.table[prefix_of, :shared]
            self.kv_len[row] = shared
        return row

    def drop(self, row: int, free_slots: bool = True) -> None:
        if free_slots:
            self.alloc.free(self.table.table[row, : self.kv_len[row]].clone())
        del self.kv_len[row]
        self.table.free(row)

    def step(self, work: list[tuple[int, int]]) -> ForwardBatch:
        """work: (row, new tokens); decodes (1 token) must come last. Checks every layer's output."""
        ids, rows, pre, ext, locs = [], [], [], [], []
        for row, n in work:
            start = self.kv_len[row]
            slots = self.alloc.alloc(n)
            self.table.table[row, start : start + n] = slots
            ids += [0] * n
            rows.append(row)
            pre.append(start)
            ext.append(n)
            locs.append(slots)
        batch = ForwardBatch.build(ids, rows, pre, ext, torch.cat(locs), self.table.table, list(range(len(ids))))
        total = len(ids)
        for layer in range(LAYERS):
            q = torch.randn(total, HEADS, HEAD_DIM, generator=self.gen).to(self.dtype)
            k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=self.gen).to(self.dtype)
            v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=self.gen).to(self.dtype)
            got = self.backend.forward(q, k, v, layer, batch, SCALE)
            want = self.reference(q, layer, rows, pre, ext)
            assert got.dtype == self.dtype
            if self.dtype == torch.float32:  # the same float32 terms summed in another order (the
                # kernel's key blocks and online softmax vs SDPA's): rounding noise, ~1e-7 of each term
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
            else:  # computed in float32 over the same values: one bfloat16 rounding of the output
                torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=2**-8)
        for row, n in work:
            self.kv_len[row] += n
        return batch

    def reference(self, q, layer, rows, pre, ext) -> torch.Tensor:
        outs, pos = [], 0
        for row, p, n in zip(rows, pre, ext):
            slots = self.table.table[row, : p + n]
            keys = self.pool.k[layer][slots].transpose(0, 1).float()  # [KVH, S, D]
            values = self.pool.v[layer][slots].transpose(0, 1).float()
            rep = HEADS // KV_HEADS
            keys, values = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
            qq = q[pos : pos + n].transpose(0, 1).float()  # [H, n, D]
            mask = torch.arange(p + n)[None, :] <= (p + torch.arange(n))[:, None]
            out = F.scaled_dot_product_attention(qq, keys, values, attn_mask=mask, scale=SCALE)
            outs.append(out.transpose(0, 1).reshape(n, HEADS * HEAD_DIM))
            pos += n
        return torch.cat(outs)


def plan_fills(sim: Sim) -> int:
    """Rows the mirror copied in full this step (0 when every decode row only appended)."""
    plan = sim.backend._plan
    assert plan is not None, "the decode group did not use the mirror"
    return 0 if plan.fill_idx is None else plan.fill_idx.shape[0]


@pytest.mark.parametrize("backend_cls", [TorchNativeAttention, MirroredAttention])
def test_backends_match_reference(backend_cls):
    sim = Sim(backend_cls)
    a, b = sim.new(), sim.new()
    sim.step([(a, 37), (b, 5)])  # two prefills (one extend group)
    c = sim.new(prefix_of=a, shared=20)  # shares a's first 20 slots
    sim.step([(c, 9), (a, 1), (b, 1)])  # mixed: extend group + decode group
    for _ in range(3):
        sim.step([(a, 1), (b, 1), (c, 1)])
    sim.step([(b, 4), (a, 1), (c, 1)])  # b verifies drafts (multi-token extend)
    sim.kv_len[b] -= 2  # two drafts rejected: rolled back
    sim.alloc.free(sim.table.table[b, sim.kv_len[b] : sim.kv_len[b] + 2].clone())
    for _ in range(2):
        sim.step([(a, 1), (b, 1), (c, 1)])
    sim.drop(a, free_slots=False)  # finished: its slots stay (c shares them)
    d = sim.new()
    sim.step([(d, 3), (c, 1), (b, 1)])
    sim.step([(c, 1), (d, 1), (b, 1)])  # new order, new member
    sim.step([(d, 5), (b, 2), (c, 1)])  # two draft rows and a decode
    many = [sim.new() for _ in range(8)]
    sim.step([(r, 4 + i) for i, r in enumerate(many)])
    sim.step([(b, 3)] + [(r, 1) for r in [c, d] + many])  # drafts in a big batch: extend group


def test_mirror_appends_in_steady_state_and_refills_only_what_changed():
    sim = Sim(MirroredAttention)
    rows = [sim.new() for _ in range(4)]
    sim.step([(r, 10 + 3 * i) for i, r in enumerate(rows)])
    sim.step([(r, 1) for r in rows])
    assert plan_fills(sim) == 4  # first decode: everything copied once
    for _ in range(3):
        sim.step([(r, 1) for r in rows])
        assert plan_fills(sim) == 0  # then one token per row per step
    sim.step([(r, 1) for r in reversed(rows)])  # same members, another order
    assert plan_fills(sim) == 0
    for _ in range(2):  # which stays: the steady plan (fused with the
        sim.step([(r, 1) for r in reversed(rows)])  # kernels), each row at the mirror row it holds
        assert plan_fills(sim) == 0 and sim.backend._plan.order is not None
        assert sim.backend._fused == cpu_kernels.enabled(sim.pool.k[0])
    sim.drop(rows[1])  # one leaves, one joins
    e = sim.new()
    sim.step([(e, 6)])
    live = [rows[0], rows[2], rows[3], e]
    sim.step([(r, 1) for r in live])
    assert plan_fills(sim) <= 2  # the newcomer (and one moved into the gap)
    sim.step([(rows[0], 3), (rows[2], 1), (rows[3], 1), (e, 2)])  # drafts verified in the decode group
    assert sim.backend._plan.max_q == 3 and plan_fills(sim) == 0
    sim.kv_len[rows[0]] -= 1  # one draft rejected: the mirror holds more
    sim.step([(r, 1) for r in live])
    assert plan_fills(sim) == 0
    sim.step([(rows[2], 1), (rows[3], 1), (e, 1)])  # rows[0] sits a step out
    sim.step([(r, 1) for r in live])
    assert plan_fills(sim) == 1  # it refills; the others append


def test_rewritten_table_row_and_recycled_slots_refill():
    sim = Sim(MirroredAttention)
    a, b, other = sim.new(), sim.new(), sim.new()
    sim.step([(a, 12), (b, 12), (other, 5)])  # same step: same write stamps
    sim.step([(a, 1), (b, 1)])
    # Prefix-cache dedup: a's first 5 tokens now point at other slots (other K/V).
    sim.table.table[a, :5] = sim.table.table[other, :5]
    sim.step([(a, 1), (b, 1)])
    assert plan_fills(sim) == 1
    # b finishes; a new request gets b's row and, by recycling, exactly b's slots in order: only
    # the write stamps can tell its K/V apart.
    slots = sim.table.table[b, :14].clone()
    sim.drop(b, free_slots=False)
    sim.alloc._free = torch.cat((slots, sim.alloc._free[sim.alloc._head :]))  # b's slots handed out next
    sim.alloc._head = 0
    b2 = sim.new()
    assert b2 == b
    sim.step([(b2, 14)])
    assert torch.equal(sim.table.table[b2, :14], slots)
    sim.step([(a, 1), (b2, 1)])
    assert plan_fills(sim) == 1


def test_mirror_grows_past_its_length_step_and_falls_back_over_budget():
    sim = Sim(MirroredAttention)
    a = sim.new()
    sim.step([(a, 250)])
    for _ in range(10):  # crosses the 256-token capacity step
        sim.step([(a, 1)])
    mirror = sim.backend.mirror
    assert mirror.capacity[1] >= 261
    assert all(float(t[:, :, 262:].abs().max()) == 0 for t in mirror.k + mirror.v)  # fresh rows zeroed
    if weight_arena.huge_page_buffer(1) is not None:  # one 2 MB-aligned huge-page buffer, in read order
        first, each = mirror.k[0].data_ptr(), mirror.k[0].numel() * mirror.k[0].element_size()
        assert first % weight_arena.HUGE_PAGE == 0
        for i in range(LAYERS):
            assert (
                mirror.k[i].data_ptr() == first + 2 * i * each and mirror.v[i].data_ptr() == first + (2 * i + 1) * each
            )
    tight = Sim(MirroredAttention, mirror_budget_bytes=1)
    r = tight.new()
    tight.step([(r, 8)])
    tight.step([(r, 1)])  # checked against the reference all the same
    assert tight.backend._plan is None


def test_decode_group_takes_small_draft_extends_only():
    def groups(pre, ext):
        locs = torch.arange(1, sum(ext) + 1)
        table = torch.zeros((len(pre), 64), dtype=torch.int64)
        b = ForwardBatch.build([0] * sum(ext), list(range(len(pre))), pre, ext, locs, table, [0])
        return [(g.bsz, g.max_q, g.decode) for g in b.groups]

    assert groups([0, 9, 7, 5], [6, 3, 1, 1]) == [(1, 6, False), (3, 3, True)]  # prefill | drafts + decodes
    assert groups([9, 7], [1, 1]) == [(2, 1, True)]
    assert groups([3, 9], [20, 1]) == [(1, 20, False), (1, 1, True)]  # a long extend stays out
    assert groups([9] * 10, [2] + [1] * 9) == [(1, 2, False), (9, 1, True)]  # too many rows to pad


@pytest.mark.parametrize("lens", [[9], [9, 14, 5]])
def test_advanced_batch_equals_the_built_one(lens):
    # A decode batch one token further, by ForwardBatch.advance, holds what building it anew holds:
    # positions, context lengths, the table's slots and the padding mask of rows of unequal length.
    table = torch.arange(4 * 32, dtype=torch.int64).view(4, 32) + 1
    rows = [2, 0, 3][: len(lens)]
    written = torch.tensor([r * 32 + n + 1 for r, n in zip(rows, lens)])
    first = ForwardBatch.build([5] * len(lens), rows, lens, [1] * len(lens), written, table, list(range(len(lens))))
    assert first.advanceable
    slots = torch.tensor([r * 32 + n + 2 for r, n in zip(rows, lens)])
    ids = [7 + i for i in range(len(lens))]
    nxt = first.advance(ids, slots, table)
    ref = ForwardBatch.build(ids, rows, [n + 1 for n in lens], [1] * len(lens), slots, table, list(range(len(lens))))
    assert nxt.repeat and nxt.advanceable and not ref.repeat
    for name in ("input_ids", "positions", "out_cache_loc", "logits_index"):
        assert torch.equal(getattr(nxt, name), getattr(ref, name)), name
    g, h = nxt.groups[0], ref.groups[0]
    fields = ("start", "end", "bsz", "max_q", "max_kv", "rows", "decode")
    assert [getattr(g, f) for f in fields] == [getattr(h, f) for f in fields]
    for name in ("kv_indices", "prefix_lens", "seq_lens"):
        assert torch.equal(getattr(g, name), getattr(h, name)), name
    assert (g.attn_mask is None) == (h.attn_mask is None) == (len(set(lens)) == 1)
    assert g.attn_mask is None or torch.equal(g.attn_mask, h.attn_mask)
    assert g.q_scatter is None and h.q_scatter is None
