"""DecodeMirror: the decode rows' K/V kept contiguous across steps, so decode attention reads one
padded `[rows, kv_heads, len, head_dim]` block per layer instead of gathering every request's
whole context from the pool every step (on the CPU the gather costs more than the attention).

Each step appends only the new token's K/V to a request that was mirrored the step before.
A request is identified by its request-to-token row; its mirror row is reused only when it
provably still equals the pool: the same length, the same slot ids, and no slot rewritten since
it was copied (every pool write is stamped with the step that made it). Anything else — a new
request, retraction, a rewritten table row (prefix-cache dedup), rejected drafts, a request
that skipped a step — refills that row from the pool. No caller has to invalidate anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.cpu import cpu_kernels
from ..model_executor import weight_arena
from ..model_executor.forward_batch import AttnGroup, cached_arange
from .memory_pool import KVPool, index_copy_bits_, index_select_bits

_LEN_STEP = 256  # mirror length grows in steps of this many tokens
_ROW_STEP = 8  # and its row count (above 8 rows) in steps of this many rows


@dataclass
class MirrorPlan:
    """What one step does to the mirror; computed once per step, applied per layer."""

    n: int  # decode rows; mirror rows [0, n) hold them
    length: int  # keys attended (the group's max_kv)
    max_q: int  # new tokens of the longest row (1 unless drafts are verified)
    target: torch.Tensor  # [n] mirror row of batch row b
    order: torch.Tensor | None  # [n] batch row held by mirror row m; None when identity
    q_slots: torch.Tensor | None  # max_q > 1: [tokens] place of each token in the padded
    # [n * max_q] query layout, mirror order
    keep_tok: torch.Tensor | None  # tokens appended in place (rows kept); None when all are
    keep_at: torch.Tensor  # [len(keep_tok) * kv_heads] where their K/V rows go in the
    # mirror viewed as [rows * kv_heads * length, head_dim]
    fill_idx: torch.Tensor | None  # [F, fill_len] pool slots of rows copied in full; None if none
    fill_t: torch.Tensor | slice  # their mirror rows (a slice when contiguous)
    mask: torch.Tensor | None  # [n, 1, max_q, length] additive mask (mirror order); None if none needed


class DecodeMirror:
    """Contiguous per-layer K/V of the current decode rows, plus what validates them."""

    def __init__(self, pool: KVPool, budget_bytes: int, mask_dtype: torch.dtype | None = None):
        self.pool = pool
        self.num_layers = len(pool.k)
        _, self.kv_heads, self.head_dim = pool.k[0].shape
        self.dtype = pool.k[0].dtype
        self.mask_dtype = mask_dtype or self.dtype  # the dtype SDPA runs in over the mirror
        self.budget_bytes = budget_bytes
        # Step stamp of the last write to every pool slot: a copied slot is stale once it changes.
        self.slot_stamp = torch.zeros(pool.k[0].shape[0], dtype=torch.int64)
        self.clock = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.generation = 0  # counts the replacements of the blocks in k / v (their holders compare it)
        self._reset_index(0, 0)

    def _reset_index(self, rows: int, length: int) -> None:
        self.ids = torch.zeros((rows, length), dtype=torch.int64)  # pool slot of each entry
        self.stamps = torch.full((rows, length), -1, dtype=torch.int64)  # its stamp when copied
        self.lens = torch.zeros(rows, dtype=torch.int64)  # valid entries per mirror row
        self.mirror_row: dict[int, int] = {}  # request row -> mirror row

    @property
    def capacity(self) -> tuple[int, int]:
        return tuple(self.ids.shape)

    def nbytes(self, rows: int, length: int) -> int:
        return 2 * self.num_layers * rows * self.kv_heads * length * self.head_dim * self.dtype.itemsize

    def begin_step(self, written: torch.Tensor) -> None:
        """Start a step that writes pool slots `written` (every group's): stamp them, so that a
        mirrored copy of any of them reads as stale from now on."""
        self.clock += 1
        self.slot_stamp.index_fill_(0, written, self.clock)  # (a lighter op than indexed assignment)

    def plan(self, g: AttnGroup, with_mask: bool = True) -> MirrorPlan | None:
        """Decide, for decode group `g`, which rows only append their new tokens and which are
        copied in full from the pool. None when the mirror would exceed its memory budget (the
        caller gathers instead). Call after `begin_step`. `with_mask=False` leaves out the additive
        mask (for a caller that attends by the rows' lengths, `lens`)."""
        n, length, max_q = g.bsz, g.max_kv, g.max_q
        if not self._ensure_capacity(n, length):
            return None
        pre, seq = g.prefix_lens, g.seq_lens
        kv = g.kv_indices.view(n, length)
        if max_q == 1 and not with_mask:
            plan = self._plan_steady(g, kv)
            if plan is not None:
                return plan
        target, keep = self._match(g, kv)
        arange_n = torch.arange(n)
        order = None
        if not bool((target == arange_n).all()):
            order = torch.empty_like(target)
            order[target] = arange_n
        # Token t: its row, its position.
        ext = seq - pre
        if max_q == 1:
            row_of, pos = arange_n, pre
        else:
            row_of = torch.repeat_interleave(arange_n, ext)
            pos = pre[row_of] + torch.arange(row_of.numel()) - (torch.cumsum(ext, 0) - ext)[row_of]
        # Book-keeping for the next step.
        self.mirror_row = {row: int(t) for row, t in zip(g.rows, target.tolist())}
        self.lens[:n] = seq if order is None else seq[order]
        fill_b = (~keep).nonzero().view(-1)
        fill_idx, fill_t = None, slice(0, 0)
        if fill_b.numel():
            fill_len = int(seq[fill_b].max())
            fill_idx = kv[fill_b, :fill_len]
            ft = target[fill_b]
            lo = int(ft[0])
            contiguous = bool((ft == torch.arange(lo, lo + ft.numel())).all())
            fill_t = slice(lo, lo + ft.numel()) if contiguous else ft
            self.ids[ft, :fill_len] = fill_idx
            self.stamps[ft, :fill_len] = self.slot_stamp[fill_idx]
        keep_tok = keep[row_of].nonzero().view(-1)
        kt, kpos = target[row_of[keep_tok]], pos[keep_tok]
        if keep_tok.numel():
            self.ids[kt, kpos] = kv[row_of[keep_tok], kpos]
            self.stamps[kt, kpos] = self.clock
        keep_at = (
            (kt[:, None] * self.kv_heads + torch.arange(self.kv_heads)[None, :]) * self.capacity[1] + kpos[:, None]
        ).reshape(-1)
        q_slots = None
        if max_q > 1:
            q_slots = target[row_of] * max_q + pos - pre[row_of]
        return MirrorPlan(
            n,
            length,
            max_q,
            target,
            order,
            q_slots,
            None if keep_tok.numel() == row_of.numel() else keep_tok,
            keep_at,
            fill_idx,
            fill_t,
            self._mask(n, length, max_q, ext if order is None else ext[order]) if with_mask else None,
        )

    def _plan_steady(self, g: AttnGroup, kv: torch.Tensor) -> MirrorPlan | None:
        """The steady step in one op (`cpu_kernels.mirror_steady_`): every row at the mirror row it
        had (in any order: rows that came or went earlier leave the rest permuted, which must not
        cost a full plan every step after), each mirror still equal to the pool, one token appended
        each. None where that does not hold (nothing changed then) or the kernels are not built."""
        n = g.bsz
        targets = [self.mirror_row.get(r, -1) for r in g.rows]
        # distinct by construction (one full plan's mapping, unchanged since); checked all the same:
        # two rows appending to one mirror row would corrupt it
        if not cpu_kernels.kv_enabled(self.pool.k[0]) or not all(0 <= t < n for t in targets) or len(set(targets)) != n:
            return None
        identity = targets == list(range(n))
        target = cached_arange(n, "cpu") if identity else torch.tensor(targets)
        order = None
        if not identity:
            order = torch.empty_like(target)
            order[target] = cached_arange(n, "cpu")
        # mirror_row keeps rows that left the batch (the full plan drops them): harmless, any row is
        # checked against the pool before its mirror is used
        return self._append_plan(g, kv, target, order)

    def _append_plan(
        self, g: AttnGroup, kv: torch.Tensor, target: torch.Tensor, order: torch.Tensor | None
    ) -> MirrorPlan | None:
        """`mirror_steady_` for batch row b at mirror row `target[b]` (`order`: its inverse, None when
        identity), and the plan of that step; None where a mirror no longer equals the pool."""
        keep_at = cpu_kernels.ops.mirror_steady_(
            self.ids, self.stamps, self.lens, self.slot_stamp, kv, g.prefix_lens, target, self.clock, self.kv_heads
        )
        if keep_at.numel() == 0:
            return None
        return MirrorPlan(g.bsz, g.max_kv, 1, target, order, None, None, keep_at, None, slice(0, 0), None)

    def plan_repeat(self, g: AttnGroup, last: MirrorPlan, written: torch.Tensor) -> MirrorPlan | None:
        """`begin_step(written)` and the plan of `g`, the rows of the steady plan `last` (the step
        before's) each one token further: their mirror rows are `last`'s, and only the mirrors'
        equality to the pool is checked again (`mirror_steady_`). None where that does not hold (the
        caller then begins the step as usual: stamping the same slots again changes nothing)."""
        self.begin_step(written)
        if not self._ensure_capacity(g.bsz, g.max_kv):
            return None
        return self._append_plan(g, g.kv_indices.view(g.bsz, g.max_kv), last.target, last.order)

    def _match(self, g: AttnGroup, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mirror row of each batch row, and whether it is kept (it holds at least the row's
        prefix, unchanged). Other rows get the free mirror rows of [0, n)."""
        n, length = g.bsz, g.max_kv
        pre = g.prefix_lens
        cand_b, cand_t = [], []
        for b, row in enumerate(g.rows):
            t = self.mirror_row.get(row, -1)
            if 0 <= t < n:  # rows beyond n are refilled: the batch must be mirror rows [0, n)
                cand_b.append(b)
                cand_t.append(t)
        keep = torch.zeros(n, dtype=torch.bool)
        target = torch.full((n,), -1, dtype=torch.int64)
        if cand_b:
            cb, ct = torch.tensor(cand_b), torch.tensor(cand_t)
            # More than the prefix is fine: rejected drafts, overwritten by this step's tokens.
            ok = self.lens[ct] >= pre[cb]
            if length > 1:
                old = kv[cb, : length - 1]  # prefixes are shorter than the group's max_kv
                same = (self.ids[ct, : length - 1] == old) & (self.stamps[ct, : length - 1] == self.slot_stamp[old])
                live = torch.arange(length - 1)[None, :] < pre[cb, None]
                ok &= (same | ~live).all(1)
            keep[cb[ok]] = True
            target[cb[ok]] = ct[ok]
        fill_b = (~keep).nonzero().view(-1)
        if fill_b.numel():
            used = torch.zeros(n, dtype=torch.bool)
            used[target[keep]] = True
            target[fill_b] = (~used).nonzero().view(-1)[: fill_b.numel()]
        return target, keep

    def _mask(self, n: int, length: int, max_q: int, ext_m: torch.Tensor) -> torch.Tensor | None:
        """Additive mask in mirror order: query i of mirror row m sees keys j <= lens[m] - ext + i
        (padding queries clamped to the last real one); None when nothing is masked."""
        seq_m = self.lens[:n]
        if max_q == 1:
            if bool((seq_m == length).all()):
                return None
            last = (seq_m - 1)[:, None]
        else:
            q_eff = torch.minimum(torch.arange(max_q)[None, :], (ext_m - 1)[:, None])
            last = seq_m[:, None] - ext_m[:, None] + q_eff
        mask = torch.zeros((n, 1, last.shape[1], length), dtype=self.mask_dtype)
        return mask.masked_fill_(torch.arange(length)[None, None, None, :] > last[:, None, :, None], float("-inf"))

    def update(
        self, layer: int, plan: MirrorPlan, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring layer `layer` up to date (the pool already holds this step's K/V `k`, `v` of the
        decode rows, batch order) and return its keys/values `[n, kv_heads, length, head_dim]`."""
        mk, mv = self.k[layer], self.v[layer]
        if plan.keep_at.numel():
            kk = k if plan.keep_tok is None else k[plan.keep_tok]
            vv = v if plan.keep_tok is None else v[plan.keep_tok]
            index_copy_bits_(mk.view(-1, self.head_dim), plan.keep_at, kk.reshape(-1, self.head_dim))
            index_copy_bits_(mv.view(-1, self.head_dim), plan.keep_at, vv.reshape(-1, self.head_dim))
        if plan.fill_idx is not None:
            f, fill_len = plan.fill_idx.shape
            flat = plan.fill_idx.reshape(-1)
            shape = (f, fill_len, self.kv_heads, self.head_dim)
            gk = index_select_bits(self.pool.k[layer], flat).view(shape).transpose(1, 2)
            gv = index_select_bits(self.pool.v[layer], flat).view(shape).transpose(1, 2)
            if isinstance(plan.fill_t, slice):
                mk[plan.fill_t, :, :fill_len].copy_(gk)
                mv[plan.fill_t, :, :fill_len].copy_(gv)
            else:
                mk[plan.fill_t, :, :fill_len] = gk
                mv[plan.fill_t, :, :fill_len] = gv
        return mk[: plan.n, :, : plan.length], mv[: plan.n, :, : plan.length]

    def _ensure_capacity(self, n: int, length: int) -> bool:
        rows, cap_len = self.capacity
        new_rows = n if n <= _ROW_STEP else -(-n // _ROW_STEP) * _ROW_STEP
        new_len = -(-(length + 1) // _LEN_STEP) * _LEN_STEP
        # Grow when too small; shrink when four times too big (memory comes back after a peak).
        if n <= rows and length <= cap_len and 4 * self.nbytes(new_rows, new_len) >= self.nbytes(rows, cap_len):
            return True
        if self.nbytes(new_rows, new_len) > self.budget_bytes:
            self.release()
            return False
        if length > cap_len:  # growing contexts: by half again, so that resizes (a full copy) stay rare
            longer = -(-(cap_len * 3 // 2) // _LEN_STEP) * _LEN_STEP
            if longer > new_len and self.nbytes(new_rows, longer) <= self.budget_bytes:
                new_len = longer
        self._resize(new_rows, new_len)
        return True

    def _resize(self, rows: int, length: int) -> None:
        """Reallocate, keeping what still fits. Fresh memory is zeroed: masked entries are still
        multiplied by zero weights, so they must be finite."""
        keep_r, keep_l = min(rows, self.capacity[0]), min(length, self.capacity[1])
        shape = (rows, self.kv_heads, length, self.head_dim)
        fresh = self._allocate(shape)
        self.generation += 1
        for c, cache in enumerate((self.k, self.v)):
            for i in range(self.num_layers):
                new = fresh[2 * i + c]
                if cache and keep_r and keep_l:
                    new[:keep_r, :, :keep_l] = cache[i][:keep_r, :, :keep_l]
                if len(cache) > i:
                    cache[i] = new
                else:
                    cache.append(new)
        ids, stamps, lens, where = self.ids, self.stamps, self.lens, self.mirror_row
        self._reset_index(rows, length)
        self.ids[:keep_r, :keep_l] = ids[:keep_r, :keep_l]
        self.stamps[:keep_r, :keep_l] = stamps[:keep_r, :keep_l]
        # A row cut short keeps only what fits: it stays usable while its prefix fits, else refills.
        self.lens[:keep_r] = lens[:keep_r].clamp(max=keep_l)
        self.mirror_row = {r: t for r, t in where.items() if t < keep_r}

    def _allocate(self, shape: tuple[int, ...]) -> list[torch.Tensor]:
        """Zeroed K and V blocks of `shape` for every layer (K0, V0, K1, ...: the order a step
        reads them). On the CPU they are views of one buffer in 2 MB pages (weight_arena's): a
        step streams the whole mirror, and in 4 KB pages each page is a TLB miss behind the
        weights' stream and a stop for the hardware prefetcher, which slows the step's decode
        attention."""
        count, each = 2 * self.num_layers, shape[0] * shape[1] * shape[2] * shape[3]
        buf = None
        if self.pool.k[0].device.type == "cpu" and each:
            raw = weight_arena.huge_page_buffer(count * each * self.dtype.itemsize)
            buf = None if raw is None else raw.view(self.dtype)
        if buf is None:
            return [torch.zeros(shape, dtype=self.dtype, device=self.pool.k[0].device) for _ in range(count)]
        buf.zero_()
        return [buf[j * each : (j + 1) * each].view(shape) for j in range(count)]

    def release(self) -> None:
        """Free the mirror's memory; every row refills on next use."""
        self.k, self.v = [], []
        self.generation += 1
        self._reset_index(0, 0)
