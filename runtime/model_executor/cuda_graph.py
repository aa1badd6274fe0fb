"""CUDA graphs for decode: replay one captured graph per (batch size, KV length) bucket.

Why: a decode step at a small batch does little arithmetic per kernel, and an eager forward
launches a dozen-plus kernels per layer from Python (norms, projections, RoPE, the pool write, the
gather, SDPA, the MLP). On a GPU the launch overhead, not the math, then sets the step time. A CUDA
graph records the whole step once and replays it with one launch.

How: a graph fixes every shape and address, so a pure-decode step (one attention group, one token
per request, no drafts) is padded to a captured bucket — its batch size to one of 1, 2, 4, 8, 16,
24, ... up to `cuda_graph_max_bs`, its longest context to a power of two from 256 up to the context
length — and its inputs are copied into preallocated static tensors (token ids, positions, KV
slots written, the gather index `[bs * kv_len]`, context lengths, logits rows). The graph for the
bucket is captured on first use (a warm-up run on a side stream, then `torch.cuda.graph` with one
memory pool shared by all graphs: they never run at once) and replayed; the real requests' logits
rows are copied out. Inside the graph, attention is `StaticDecodeAttention`: a pool write with
`index_copy_`, an `index_select` gather, an additive mask computed from the context lengths, and
SDPA — nothing that reads tensor values on the host.

Padded rows write their K/V to the pool's padding slot (`memory_pool.PAD_SLOT`, never handed to a
request) and attend to that one key only, so they compute finite values and touch no request.

Anything else runs eagerly: prefill and mixed steps, draft verification, batches above the largest
bucket, contexts beyond the largest KV bucket, tensor parallelism, `torch.compile`.

Graphs are on by default on CUDA (`--disable-cuda-graph`, `--cuda-graph-max-bs N`). The same runner
also runs without capture ("eager replay": the model is called on the static, padded tensors),
which is how the padding and bucketing are tested on the CPU (`ServerArgs.cuda_graph_eager`).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..mem_cache.memory_pool import FP8_DTYPES, PAD_SLOT, KVPool, index_copy_bits_, index_select_bits
from .attention import AttentionBackend, sdpa_dtype
from .forward_batch import AttnGroup, ForwardBatch

if TYPE_CHECKING:
    from .model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 64
MIN_KV_BUCKET = 256
_KV_ALIGN = 64  # the last KV bucket (the context length) is rounded up to this


def bs_buckets(max_bs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every 8 up to `max_bs` (itself included)."""
    out = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    return out if out[-1] == max_bs else out + [max_bs]


def kv_buckets(max_kv: int, min_kv: int = MIN_KV_BUCKET) -> list[int]:
    """KV lengths captured: powers of two from `min_kv` below `max_kv`, then `max_kv` (aligned)."""
    out, k = [], min_kv
    while k < max_kv:
        out.append(k)
        k *= 2
    return out + [-(-max_kv // _KV_ALIGN) * _KV_ALIGN if max_kv > min_kv else min_kv]


def attention_dtype(kv_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a graph's attention runs in: the pool's, or for an 8-bit pool what SDPA widens it to."""
    return sdpa_dtype(kv_dtype, device) if kv_dtype in FP8_DTYPES else kv_dtype


class StaticDecodeAttention(AttentionBackend):
    """Decode attention over fixed shapes, for a captured graph: one query per row, keys gathered
    from the pool through the group's `[bs * kv_len]` index, an additive `[bs, 1, 1, kv_len]` mask.
    Only the batch's static tensors are read; no host reads of tensor values."""

    def forward(self, q, k, v, layer_id, batch, scale):
        g = batch.groups[0]
        pool_k, pool_v = self.pool.k[layer_id], self.pool.v[layer_id]
        index_copy_bits_(pool_k, batch.out_cache_loc, k.to(pool_k.dtype))
        index_copy_bits_(pool_v, batch.out_cache_loc, v.to(pool_v.dtype))
        dtype = attention_dtype(pool_k.dtype, pool_k.device)
        bs, kv_len = g.bsz, g.max_kv
        kv_heads, head_dim = pool_k.shape[1], pool_k.shape[2]
        num_heads = q.shape[1]
        keys = index_select_bits(pool_k, g.kv_indices).view(bs, kv_len, kv_heads, head_dim).transpose(1, 2).to(dtype)
        values = index_select_bits(pool_v, g.kv_indices).view(bs, kv_len, kv_heads, head_dim).transpose(1, 2).to(dtype)
        # One query per head: the heads sharing a KV head become that head's query rows (GQA).
        q4 = q.to(dtype).reshape(bs, kv_heads, num_heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q4, keys, values, attn_mask=g.attn_mask, scale=scale)
        return out.reshape(bs, num_heads * head_dim).to(q.dtype)


@dataclass
class _Entry:
    """One (batch size, KV length) bucket: its static batch (views of the shared buffers) and,
    once captured, its graph and output."""

    batch: ForwardBatch
    masked: torch.Tensor  # [bs, kv_len] bool scratch for the mask
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the graph's output `[bs, vocab]`


class DecodeGraphRunner:
    """Runs eligible decode steps on static, padded inputs: replayed from CUDA graphs (`capture`)
    or called eagerly on the same tensors (the CPU test mode). `forward(batch)` returns the logits,
    or None when the step must run the ordinary way."""

    def __init__(self, runner: ModelRunner, max_bs: int, max_kv: int, capture: bool, min_kv: int = MIN_KV_BUCKET):
        self.model = runner.model
        self.pool: KVPool = runner.pool
        self.eager_backend = runner.backend
        self.device = runner.device
        self.capture = capture
        self.backend = StaticDecodeAttention(self.pool)
        self.bs_buckets = bs_buckets(max_bs)
        self.kv_buckets = kv_buckets(max_kv, min_kv)
        self.max_bs, self.max_kv = self.bs_buckets[-1], self.kv_buckets[-1]
        dev, n = self.device, self.max_bs * self.max_kv
        # Shared by every bucket (each uses a prefix): one graph runs at a time.
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.full((self.max_bs,), PAD_SLOT, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=dev)
        self.logits_index = torch.arange(self.max_bs, dtype=torch.int64, device=dev)
        self.kv_indices = torch.full((n,), PAD_SLOT, dtype=torch.int64, device=dev)
        self.mask = torch.zeros(n, dtype=attention_dtype(self.pool.k[0].dtype, dev), device=dev)
        self.masked = torch.zeros(n, dtype=torch.bool, device=dev)
        self.kv_pos = torch.arange(self.max_kv, dtype=torch.int64, device=dev)
        self.rows = torch.arange(self.max_bs, dtype=torch.int64, device=dev)
        self.entries: dict[tuple[int, int], _Entry] = {}
        self.graph_pool = None
        self.failed = False
        # counters (read by tests and benchmarks)
        self.num_replays = 0
        self.num_padded_rows = 0

    # --- the step --------------------------------------------------------------------------------
    def bucket(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """The (batch size, KV length) bucket of a pure-decode step; None for any other step."""
        if self.failed or len(batch.groups) != 1:
            return None
        g = batch.groups[0]
        if not g.decode or g.max_q != 1 or g.end != g.bsz or batch.logits_index.numel() > g.bsz:
            return None
        if g.bsz > self.max_bs or g.max_kv > self.max_kv:
            return None
        return (
            self.bs_buckets[bisect.bisect_left(self.bs_buckets, g.bsz)],
            self.kv_buckets[bisect.bisect_left(self.kv_buckets, g.max_kv)],
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Float32 logits `[len(batch.logits_index), vocab]`, or None: run this step eagerly."""
        key = self.bucket(batch)
        if key is None:
            return None
        entry = self.entries.get(key) or self._new_entry(*key)
        self._load(entry, batch)
        # The CPU backend's decode mirror stamps every pool write; this step writes past it.
        mirror = getattr(self.eager_backend, "mirror", None)
        if mirror is not None:
            mirror.begin_step(batch.out_cache_loc)
        m = batch.logits_index.numel()
        if not self.capture:
            logits = self._step(entry)[:m]
        else:
            if entry.graph is None and not self._capture(entry, key):
                return None  # capture failed: eager from now on
            entry.graph.replay()
            logits = entry.logits[:m].clone()  # the graphs share memory: the next replay overwrites it
        self.num_replays += 1
        self.num_padded_rows += key[0] - batch.groups[0].bsz
        return logits

    def _new_entry(self, bs: int, kv_len: int) -> _Entry:
        n = bs * kv_len
        group = AttnGroup(
            start=0,
            end=bs,
            bsz=bs,
            max_q=1,
            max_kv=kv_len,
            kv_indices=self.kv_indices[:n],
            attn_mask=self.mask[:n].view(bs, 1, 1, kv_len),
            q_scatter=None,
            rows=[],
            prefix_lens=self.seq_lens[:bs],
            seq_lens=self.seq_lens[:bs],
            decode=True,
        )
        batch = ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            groups=[group],
            logits_index=self.logits_index[:bs],
        )
        entry = _Entry(batch, self.masked[:n].view(bs, kv_len))
        self.entries[(bs, kv_len)] = entry
        return entry

    def _load(self, entry: _Entry, batch: ForwardBatch) -> None:
        """Copy the step into the bucket's static tensors; padded rows decode token 0 at position 0
        into the padding slot, seeing only that slot."""
        s, g = entry.batch, batch.groups[0]
        sg = s.groups[0]
        n, kv = g.bsz, g.max_kv
        s.input_ids[:n].copy_(batch.input_ids)
        s.input_ids[n:].zero_()
        s.positions[:n].copy_(batch.positions)
        s.positions[n:].zero_()
        s.out_cache_loc[:n].copy_(batch.out_cache_loc)
        s.out_cache_loc[n:].fill_(PAD_SLOT)
        index = sg.kv_indices.view(sg.bsz, sg.max_kv)
        index.fill_(PAD_SLOT)
        index[:n, :kv].copy_(g.kv_indices.view(n, kv))
        sg.seq_lens[:n].copy_(g.seq_lens)
        sg.seq_lens[n:].fill_(1)
        m = batch.logits_index.numel()
        s.logits_index.copy_(self.rows[: sg.bsz])
        s.logits_index[:m].copy_(batch.logits_index)

    def _step(self, entry: _Entry) -> torch.Tensor:
        """What a graph holds: the mask from the context lengths, then the model."""
        s = entry.batch
        g = s.groups[0]
        torch.ge(self.kv_pos[None, : g.max_kv], g.seq_lens[:, None], out=entry.masked)
        g.attn_mask.view(g.bsz, g.max_kv).zero_().masked_fill_(entry.masked, float("-inf"))
        return self.model(s, self.backend)

    def _capture(self, entry: _Entry, key: tuple[int, int]) -> bool:
        """Warm up, then capture the bucket's graph (the inputs are already loaded). False, with
        graphs turned off, when capture fails (e.g. an op that cannot be captured)."""
        t0 = time.perf_counter()
        try:
            with torch.cuda.device(self.device):  # capture streams belong to the current device
                if self.graph_pool is None:
                    self.graph_pool = torch.cuda.graph_pool_handle()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # lazy inits (cuBLAS handles, workspaces) happen here
                    self._step(entry)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                # thread_local: CUDA calls of other threads (grammar compiles) do not break the capture
                with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local"):
                    entry.logits = self._step(entry)
            entry.graph = graph
        except Exception as e:  # noqa: BLE001 - any failure: serve eagerly rather than not at all
            logger.warning(
                "CUDA graph capture failed for decode bucket bs=%d kv=%d (%s: %s); decoding eagerly from now on",
                key[0],
                key[1],
                type(e).__name__,
                e,
            )
            self.failed = True
            self.entries.clear()
            return False
        logger.debug(
            "captured decode CUDA graph bs=%d kv=%d in %.0f ms", key[0], key[1], (time.perf_counter() - t0) * 1e3
        )
        return True


def make_decode_graph_runner(runner: ModelRunner) -> DecodeGraphRunner | None:
    """The runner's decode graph runner, or None: on by default on CUDA (captured), on the CPU only
    when forced (`cuda_graph_eager`, no capture); never with tensor parallelism (the other ranks
    run the eager step in lockstep) or `torch.compile`."""
    args = runner.args
    if args.disable_cuda_graph or args.tp_size > 1 or args.enable_torch_compile:
        return None
    if any(getattr(layer.self_attn, "mask_kwargs", None) for layer in runner.model.layers):
        return None  # soft-capped / windowed layers (Gemma): StaticDecodeAttention runs neither
    if getattr(runner.model, "data_dependent_step", False):
        return None  # the MoE models pick experts by the batch's routing: no fixed graph

    if runner.device.type != "cuda" and not args.cuda_graph_eager:
        return None
    max_bs = args.cuda_graph_max_bs or min(args.max_running_requests, DEFAULT_MAX_BS)
    capture = runner.device.type == "cuda" and not args.cuda_graph_eager
    return DecodeGraphRunner(runner, max_bs=max_bs, max_kv=runner.context_len, capture=capture)
