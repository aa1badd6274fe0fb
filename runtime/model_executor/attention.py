"""Attention backends. One interface: write this step's K/V into the pool, then attend over
each request's context read through the request-to-token table.

- `TorchNativeAttention` (CPU and GPU): per attention group one SDPA call over a padded batch
  gathered from the pool. Gather buffers and additive masks are made once per step, not per layer.
- `MirroredAttention` (the CPU default): the same for prefill groups, but the decode group reads a
  `DecodeMirror` that appends one token per request per step instead of re-gathering every
  context: on the CPU the gather costs more than the attention itself. One-token decode rows go
  through the fused `cpu_kernels.decode_attention` (SDPA where the kernels are not built).
- `FlashAttnVarlen` (CUDA, when `flash_attn` is importable): unpadded varlen kernels.

A layer that asks for logit soft-capping or a sliding window (Gemma 2 / 3) always takes
`TorchNativeAttention`'s gathered path, in every backend, with the cap and a position mask of the
window applied in eager ops: the fused kernels, the decode mirror and flash-attn run neither.
Every key stays in the pool (a window only masks), so the prefix cache and paging are unchanged.

`make_attention_backend(pool, device)` picks one.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..kernels.cpu import cpu_kernels
from ..mem_cache.decode_mirror import DecodeMirror, MirrorPlan
from ..mem_cache.memory_pool import FP8_DTYPES, KVPool, index_select_bits
from .forward_batch import AttnGroup, ForwardBatch, cached_arange


def sdpa_dtype(kv_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype SDPA runs in over a pool of `kv_dtype`: on the CPU a 16-bit or 8-bit pool is
    widened to float32 (bfloat16 SDPA is ~3x slower there for these head sizes; float32 holds the
    16-bit and 8-bit values exactly, so the result is the same as over a float32 pool of the same
    values); on a GPU an 8-bit pool to bfloat16 (SDPA takes no fp8)."""
    if kv_dtype in FP8_DTYPES:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return torch.float32 if device.type == "cpu" and kv_dtype in (torch.bfloat16, torch.float16) else kv_dtype


class AttentionBackend:
    """`forward(q, k, v, layer_id, batch, scale)`: q `[T, H, D]`, k/v `[T, KVH, D]` -> `[T, H*D]`.
    Optional `softcap` (scores -> softcap * tanh(scores / softcap)) and `window` (a query at
    position p sees keys at positions > p - window) where the backend takes them."""

    def __init__(self, pool: KVPool):
        self.pool = pool

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
        softcap: float | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError


class TorchNativeAttention(AttentionBackend):
    """SDPA over K/V gathered from the pool into a padded `[B, KVH, max_kv, D]` batch."""

    def __init__(self, pool: KVPool):
        super().__init__(pool)
        self.kv_dtype = pool.k[0].dtype
        self.sdpa_dtype = sdpa_dtype(self.kv_dtype, pool.k[0].device)
        self._batch: ForwardBatch | None = None
        self._masks: list[torch.Tensor | None] = []
        self._scratch: dict[str, torch.Tensor] = {}
        self._begun: ForwardBatch | None = None
        self._window_masks: dict[tuple[int, int], torch.Tensor] = {}

    def forward(self, q, k, v, layer_id, batch, scale, softcap=None, window=None):
        if batch is self._begun:  # the model began this step already
            self._begun = None
        elif layer_id == 0 or batch is not self._batch:
            self._begin(batch)
        if softcap is None and window is None:
            return self._forward(q, k, v, layer_id, batch, scale)
        # the eager fallback: whatever the subclass, no mirror, kernel or flash-attn for this layer
        k, v = k.to(self.kv_dtype), v.to(self.kv_dtype)
        self.pool.write(layer_id, batch.out_cache_loc, k, v)
        outs = []
        for i, g in enumerate(batch.groups):
            mask = self._masks[i] if window is None else self._window_mask(i, g, window)
            outs.append(self._attend_gathered(q[g.start : g.end], layer_id, g, mask, scale, softcap))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _window_mask(self, i: int, g: AttnGroup, window: int) -> torch.Tensor:
        """Group i's additive mask for a sliding window, made once per step: query i of request b
        (position prefix_b + i; padding queries clamped to the last real one) sees keys j with
        position - window < j <= position."""
        key = (i, window)
        if key not in self._window_masks:
            pre, ext = g.prefix_lens, g.seq_lens - g.prefix_lens
            q_eff = torch.minimum(cached_arange(g.max_q, pre.device)[None, :], (ext - 1)[:, None])
            pos = (pre[:, None] + q_eff)[:, None, :, None]  # [bsz, 1, max_q, 1]
            j = cached_arange(g.max_kv, pre.device)
            keep = (j <= pos) & (j > pos - window)
            self._window_masks[key] = _additive(keep.to(g.kv_indices.device), self.sdpa_dtype)
        return self._window_masks[key]

    def _forward(self, q, k, v, layer_id, batch, scale):
        k, v = k.to(self.kv_dtype), v.to(self.kv_dtype)
        self.pool.write(layer_id, batch.out_cache_loc, k, v)
        outs = [self._attend_group(i, g, q, k, v, layer_id, scale) for i, g in enumerate(batch.groups)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _begin(self, batch: ForwardBatch) -> None:
        """Once per step: what every layer shares."""
        self._batch = batch
        self._window_masks = {}
        self._masks = [None if g.attn_mask is None else _additive(g.attn_mask, self.sdpa_dtype) for g in batch.groups]

    def _attend_group(self, i: int, g: AttnGroup, q, k, v, layer_id: int, scale: float) -> torch.Tensor:
        return self._attend_gathered(q[g.start : g.end], layer_id, g, self._masks[i], scale)

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """A grow-only scratch tensor: large per-layer allocations would page-fault every step."""
        numel = 1
        for s in shape:
            numel *= s
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._scratch[name] = buf
        return buf[:numel].view(shape)

    def _attend_gathered(
        self,
        q: torch.Tensor,
        layer_id: int,
        g: AttnGroup,
        mask: torch.Tensor | None,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        pool_k, pool_v = self.pool.k[layer_id], self.pool.v[layer_id]
        kv_heads = pool_k.shape[1]
        shape = (g.bsz * g.max_kv, kv_heads, head_dim)
        keys = index_select_bits(pool_k, g.kv_indices, out=self._buffer("k", shape, pool_k.dtype, pool_k.device))
        values = index_select_bits(pool_v, g.kv_indices, out=self._buffer("v", shape, pool_v.dtype, pool_v.device))
        keys = keys.view(g.bsz, g.max_kv, kv_heads, head_dim).transpose(1, 2).to(self.sdpa_dtype)
        values = values.view(g.bsz, g.max_kv, kv_heads, head_dim).transpose(1, 2).to(self.sdpa_dtype)
        dtype = q.dtype
        q = q.to(self.sdpa_dtype)
        if g.q_scatter is None:
            qp = q.reshape(g.bsz, g.max_q, num_heads, head_dim)
        else:
            qp = self._buffer("q", (g.bsz * g.max_q, num_heads, head_dim), q.dtype, q.device).zero_()
            qp[g.q_scatter] = q
            qp = qp.view(g.bsz, g.max_q, num_heads, head_dim)
        if softcap is None:
            out = F.scaled_dot_product_attention(
                qp.transpose(1, 2), keys, values, attn_mask=mask, scale=scale, enable_gqa=num_heads != kv_heads
            )
        else:
            out = _softcapped_attention(qp.transpose(1, 2), keys, values, mask, scale, softcap)
        out = out.transpose(1, 2).reshape(g.bsz * g.max_q, num_heads * head_dim)
        out = out if g.q_scatter is None else out[g.q_scatter]
        return out.to(dtype)


class MirroredAttention(TorchNativeAttention):
    """Decode rows through a `DecodeMirror` (one appended token per step); prefill groups, and
    any step whose mirror would exceed `mirror_budget_bytes`, gather as `TorchNativeAttention`."""

    def __init__(self, pool: KVPool, mirror_budget_bytes: int | None = None):
        super().__init__(pool)
        if mirror_budget_bytes is None:
            mirror_budget_bytes = default_mirror_budget(pool)
        self.mirror = DecodeMirror(pool, mirror_budget_bytes, mask_dtype=self.sdpa_dtype)
        self._plan: MirrorPlan | None = None
        self._kernel = False  # this step's one-token decode rows go through cpu_kernels.decode_attention
        self._fused = False

    def _begin(self, batch: ForwardBatch) -> None:
        super()._begin(batch)
        self.mirror.begin_step(batch.out_cache_loc)
        last = batch.groups[-1] if batch.groups else None
        # one-token rows through the fused kernel take their lengths, not a mask
        kernel = self._kernel = last is not None and last.max_q == 1 and cpu_kernels.kv_enabled(self.pool.k[0])
        plan = self._plan = self.mirror.plan(last, with_mask=not kernel) if last is not None and last.decode else None
        # The steady decode step (only decode rows, each appending one token to the mirror row it
        # holds): K/V writes and attention in two fused ops per layer.
        self._fused = (
            plan is not None
            and len(batch.groups) == 1
            and plan.max_q == 1
            and plan.keep_tok is None
            and plan.fill_idx is None
            and kernel
        )

    @property
    def _rows(self) -> torch.Tensor | None:
        """Batch row b's mirror row, for the attention kernel (None: row b)."""
        plan = self._plan
        return None if plan is None or plan.order is None else plan.target

    def begin_fused_decode(self, batch: ForwardBatch) -> tuple | None:
        """Begin `batch`'s step ahead of its layers. On a steady decode step (see `_begin`), what
        `cpu_kernels.decode_layers_` takes to write every layer's K/V and attend: (a key that changes
        whenever the blocks below are replaced, (pool K, pool V, mirror K, mirror V) per layer,
        (slots, where the K/V rows go in the mirror, mirror lengths, each batch row's mirror row or
        None)); else None, and the layers then call `forward` as usual (without beginning the step
        again)."""
        plan = None
        if batch.repeat and self._fused:  # the step before's fused one, each row a token further
            plan = self.mirror.plan_repeat(batch.groups[0], self._plan, batch.out_cache_loc)
        if plan is not None:
            self._batch, self._plan = batch, plan
        else:
            self._begin(batch)
        if not self._fused:
            self._begun = batch
            return None
        mirror = self.mirror
        return (
            (mirror, mirror.generation),
            (self.pool.k, self.pool.v, mirror.k, mirror.v),
            (batch.out_cache_loc, self._plan.keep_at, mirror.lens, self._rows),
        )

    def _forward(self, q, k, v, layer_id, batch, scale):
        if not (self._fused and cpu_kernels.enabled(k)):
            return super()._forward(q, k, v, layer_id, batch, scale)
        plan, mk, mv = self._plan, self.mirror.k[layer_id], self.mirror.v[layer_id]
        cpu_kernels.kv_write_(
            self.pool.k[layer_id], self.pool.v[layer_id], batch.out_cache_loc, k, v, mk, mv, plan.keep_at
        )
        # the mirror as it lies: its rows past plan.n and keys past each row's length are not read
        return cpu_kernels.decode_attention(q, mk, mv, self.mirror.lens, scale, self._rows).view(plan.n, -1)

    def _attend_group(self, i, g, q, k, v, layer_id, scale):
        if self._plan is None or i != len(self._batch.groups) - 1:
            return super()._attend_group(i, g, q, k, v, layer_id, scale)
        plan = self._plan
        keys, values = self.mirror.update(layer_id, plan, k[g.start : g.end], v[g.start : g.end])
        q = q[g.start : g.end]
        dtype, (_, num_heads, head_dim), n = q.dtype, q.shape, plan.n
        kv_heads = keys.shape[1]
        if not (plan.max_q == 1 and self._kernel):  # SDPA: one dtype for all of them
            q, keys, values = q.to(self.sdpa_dtype), keys.to(self.sdpa_dtype), values.to(self.sdpa_dtype)
        if plan.max_q == 1:
            if self._kernel:  # one pass over each row's K/V, no mask (2x SDPA's speed); any dtypes
                out = cpu_kernels.decode_attention(q, keys, values, self.mirror.lens, scale, self._rows)
                return out.reshape(n, num_heads * head_dim)
            # one query per head: fold the heads sharing a KV head into the query length (GQA)
            if plan.order is not None:
                q = q[plan.order]
            q4 = q.view(n, kv_heads, num_heads // kv_heads, head_dim)
            out = F.scaled_dot_product_attention(q4, keys, values, attn_mask=plan.mask, scale=scale)
            out = out.reshape(n, num_heads * head_dim)
            out = out if plan.order is None else out[plan.target]
        else:  # drafts: padded queries, mirror order
            qp = self._buffer("q", (n * plan.max_q, num_heads, head_dim), q.dtype, q.device).zero_()
            qp[plan.q_slots] = q
            qp = qp.view(n, plan.max_q, num_heads, head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                qp, keys, values, attn_mask=plan.mask, scale=scale, enable_gqa=num_heads != kv_heads
            )
            out = out.transpose(1, 2).reshape(n * plan.max_q, num_heads * head_dim)[plan.q_slots]
        return out.to(dtype)


class FlashAttnVarlen(TorchNativeAttention):
    """CUDA with `flash_attn` (fp16 / bf16 KV): gather each group's K/V unpadded and run the varlen
    kernel (no padding, no mask; causal is aligned bottom-right, i.e. after each prefix). Imported
    and constructed only on CUDA; not run on this project's CPU machines."""

    def __init__(self, pool: KVPool):
        super().__init__(pool)
        from flash_attn import flash_attn_varlen_func

        self._varlen = flash_attn_varlen_func
        self._cu: list[tuple] = []

    def _begin(self, batch: ForwardBatch) -> None:
        super()._begin(batch)
        self._cu = []
        for g in batch.groups:
            device = g.kv_indices.device
            seq = g.seq_lens.to(device)
            ext = seq - g.prefix_lens.to(device)
            cu_q = F.pad(torch.cumsum(ext, 0), (1, 0)).to(torch.int32)
            cu_k = F.pad(torch.cumsum(seq, 0), (1, 0)).to(torch.int32)
            pos = torch.arange(g.max_kv, device=device)
            valid = (pos[None, :] < seq[:, None]).reshape(-1)
            self._cu.append((cu_q, cu_k, g.kv_indices[valid], g.max_q, g.max_kv))

    def _attend_group(self, i, g, q, k, v, layer_id, scale):
        if self.kv_dtype not in (torch.float16, torch.bfloat16):
            return super()._attend_group(i, g, q, k, v, layer_id, scale)
        cu_q, cu_k, idx, max_q, max_kv = self._cu[i]
        keys = self.pool.k[layer_id].index_select(0, idx)
        values = self.pool.v[layer_id].index_select(0, idx)
        out = self._varlen(
            q[g.start : g.end].to(self.kv_dtype),
            keys,
            values,
            cu_q,
            cu_k,
            max_q,
            max_kv,
            softmax_scale=scale,
            causal=True,
        )
        return out.reshape(g.end - g.start, -1).to(q.dtype)


def default_mirror_budget(pool: KVPool) -> int:
    """At most as much again as the pool, and half the memory the pool leaves free (its pages
    are mostly untouched yet, so `available` still counts them)."""
    pool_bytes = sum(t.numel() * t.element_size() for t in pool.k + pool.v)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(pool_bytes, max(available - pool_bytes, 0) // 2)


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with Gemma 2's logit soft-capping, in HF's order (scale, cap, mask, float32
    softmax): q `[B, H, Q, D]`, k/v `[B, KVH, K, D]`, additive mask `[B, 1, Q, K]`. SDPA has no cap."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * scale / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean keep-mask -> additive float mask: SDPA would otherwise convert it every layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def make_attention_backend(pool: KVPool, device: torch.device | str) -> AttentionBackend:
    """CPU: `MirroredAttention`. CUDA: `FlashAttnVarlen` when flash_attn imports, else SDPA over
    the gathered pool (the gather runs at HBM bandwidth there, and GPU memory is kept for the pool)."""
    if torch.device(device).type == "cuda":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return TorchNativeAttention(pool)
        return FlashAttnVarlen(pool)
    return MirroredAttention(pool)
