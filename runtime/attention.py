"""Attention backends. One interface: write this step's K/V into the pool, then attend over
each request's context read through the request-to-token table.

`TorchNativeAttention` works on CPU and GPU: per attention group one SDPA call over a padded
batch gathered from the pool. Faster GPU backends plug in behind the same `forward`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .forward_batch import AttnGroup, ForwardBatch
from .memory_pool import KVPool


class AttentionBackend:
    """`forward(q, k, v, layer_id, batch, scale)`: q `[T, H, D]`, k/v `[T, KVH, D]` -> `[T, H*D]`."""

    def __init__(self, pool: KVPool):
        self.pool = pool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        raise NotImplementedError


class TorchNativeAttention(AttentionBackend):
    """SDPA over K/V gathered from the pool into a padded `[B, KVH, max_kv, D]` batch."""

    def forward(self, q, k, v, layer_id, batch, scale):
        kv_dtype = self.pool.k[layer_id].dtype
        self.pool.write(layer_id, batch.out_cache_loc, k.to(kv_dtype), v.to(kv_dtype))
        outs = [self._attend(q[g.start:g.end], layer_id, g, scale) for g in batch.groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend(self, q: torch.Tensor, layer_id: int, g: AttnGroup, scale: float) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = self.pool.k[layer_id].shape[1]
        keys = self.pool.k[layer_id].index_select(0, g.kv_indices)
        values = self.pool.v[layer_id].index_select(0, g.kv_indices)
        keys = keys.view(g.bsz, g.max_kv, kv_heads, head_dim).transpose(1, 2)
        values = values.view(g.bsz, g.max_kv, kv_heads, head_dim).transpose(1, 2)
        if g.q_scatter is None:
            qp = q.reshape(g.bsz, g.max_q, num_heads, head_dim)
        else:
            qp = q.new_zeros(g.bsz * g.max_q, num_heads, head_dim)
            qp[g.q_scatter] = q
            qp = qp.view(g.bsz, g.max_q, num_heads, head_dim)
        dtype = q.dtype
        if keys.dtype != dtype:       # the pool may be kept in a wider dtype (see ModelRunner)
            qp = qp.to(keys.dtype)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys, values, attn_mask=g.attn_mask, scale=scale,
            enable_gqa=num_heads != kv_heads)
        out = out.transpose(1, 2).reshape(g.bsz * g.max_q, num_heads * head_dim).to(dtype)
        return out if g.q_scatter is None else out[g.q_scatter]
