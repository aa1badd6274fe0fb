"""Decode attention per step, old vs new: all layers of one decode step at a batch and context
length, on a KV pool whose slots are scattered (as after a while of serving).

- old:      the original backend: gather every context from the pool each layer (fresh tensors,
            boolean mask converted by SDPA each layer);
- gather:   `TorchNativeAttention` now (gather into reused buffers, additive mask once per step);
- mirror:   `MirroredAttention` (the CPU default): steady-state steps append one token per request;
- first:    the mirror's first step (allocates, copies every row from the pool);
- refill:   a step that copies every row again (as after the batch changed completely; a request
            joining or leaving copies one or two rows).
All three run the same batches on the same pool, interleaved step by step (shared machine load).

    plait bench attention [--batch 1 8 32] [--context 128 512 1024] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

from plait.runtime.mem_cache.memory_pool import KVPool
from plait.runtime.model_executor.attention import (
    AttentionBackend,
    MirroredAttention,
    TorchNativeAttention,
)
from plait.runtime.model_executor.forward_batch import ForwardBatch

# SmolLM2-135M
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


class OldGatherAttention(AttentionBackend):
    """The backend as it was before the mirror (the baseline)."""

    def forward(self, q, k, v, layer_id, batch, scale):
        kv_dtype = self.pool.k[layer_id].dtype
        self.pool.write(layer_id, batch.out_cache_loc, k.to(kv_dtype), v.to(kv_dtype))
        outs = [self._attend(q[g.start : g.end], layer_id, g, scale) for g in batch.groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend(self, q, layer_id, g, scale):
        num_heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = self.pool.k[layer_id].shape[1]
        keys = self.pool.k[layer_id].index_select(0, g.kv_indices)
        values = self.pool.v[layer_id].index_select(0, g.kv_indices)
        keys = keys.view(g.bsz, g.max_kv, kv_heads, head_dim).transpose(1, 2)
        values = values.view(g.bsz, g.max_kv, kv_heads, head_dim).transpose(1, 2)
        qp = q.reshape(g.bsz, g.max_q, num_heads, head_dim).to(keys.dtype)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys, values, attn_mask=g.attn_mask, scale=scale, enable_gqa=num_heads != kv_heads
        )
        return out.transpose(1, 2).reshape(g.bsz * g.max_q, num_heads * head_dim).to(q.dtype)


class DecodeWorkload:
    """`bsz` requests with contexts around `context` tokens on scattered pool slots."""

    def __init__(self, bsz: int, context: int, dtype: torch.dtype, steps: int):
        gen = torch.Generator().manual_seed(0)
        self.bsz, self.steps = bsz, steps
        # Lengths differ by up to 1/8 (padding and masks matter), the longest is `context`.
        self.lens = [context - (i * context // 8) // max(bsz, 1) for i in range(bsz)]
        slots = sum(self.lens) + bsz * (steps + 2) + 1024
        self.pool = KVPool(slots, LAYERS, KV_HEADS, HEAD_DIM, dtype)
        for t in self.pool.k + self.pool.v:
            t.normal_(generator=gen)
        self.free = (torch.randperm(slots, generator=gen) + 1).tolist()
        self.table = torch.zeros((bsz, context + steps + 2), dtype=torch.int64)
        for b, n in enumerate(self.lens):
            self.table[b, :n] = torch.tensor([self.free.pop() for _ in range(n)])
        self.q = torch.randn(bsz, HEADS, HEAD_DIM, generator=gen)
        self.k = torch.randn(bsz, KV_HEADS, HEAD_DIM, generator=gen)
        self.v = torch.randn(bsz, KV_HEADS, HEAD_DIM, generator=gen)

    def next_batch(self) -> ForwardBatch:
        """One decode step: every request appends a token."""
        locs = torch.tensor([self.free.pop() for _ in range(self.bsz)])
        for b in range(self.bsz):
            self.table[b, self.lens[b]] = locs[b]
        batch = ForwardBatch.build(
            [0] * self.bsz,
            list(range(self.bsz)),
            list(self.lens),
            [1] * self.bsz,
            locs,
            self.table,
            list(range(self.bsz)),
        )
        self.lens = [n + 1 for n in self.lens]
        return batch


def run_step(backend: AttentionBackend, w: DecodeWorkload, batch: ForwardBatch) -> tuple[float, float]:
    """(wall, CPU) seconds of one step through every layer."""
    t, c = time.perf_counter(), time.process_time()
    for layer in range(LAYERS):
        backend.forward(w.q, w.k, w.v, layer, batch, HEAD_DIM**-0.5)
    return time.perf_counter() - t, time.process_time() - c


KINDS = {"old": OldGatherAttention, "gather": TorchNativeAttention, "mirror": MirroredAttention}


def measure(bsz: int, context: int, dtype: torch.dtype, steps: int) -> dict[str, dict[str, float]]:
    """ms per decode step (all layers) of each backend on the same pool and batches, interleaved
    step by step so that they share the machine's load: median wall and CPU time of `steps`
    steady steps; the mirror's first step (allocation and copy) and a later full refill (copy)."""
    w = DecodeWorkload(bsz, context, dtype, steps + 1)
    backends = {kind: cls(w.pool) for kind, cls in KINDS.items() if kind != "mirror"}
    # A server's pool is much larger than the live batch; this one is not: lift the budget.
    backends["mirror"] = MirroredAttention(w.pool, mirror_budget_bytes=1 << 40)
    first = run_step(backends["mirror"], w, w.next_batch())[0]
    times: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    for _ in range(steps):
        batch = w.next_batch()
        for kind, backend in backends.items():
            times[kind].append(run_step(backend, w, batch))
    out = {}
    for kind, ts in times.items():
        wall, cpu = sorted(t[0] for t in ts), sorted(t[1] for t in ts)
        out[kind] = {"wall_ms": 1000 * wall[len(ts) // 2], "cpu_ms": 1000 * cpu[len(ts) // 2]}
    out["mirror"]["first_ms"] = 1000 * first
    backends["mirror"].mirror.mirror_row.clear()  # forget every row: all are copied again
    out["mirror"]["refill_ms"] = 1000 * run_step(backends["mirror"], w, w.next_batch())[0]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="plait bench attention", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--steps", type=int, default=5, help="steady steps measured (median)")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="KV dtype (a bf16 model keeps float32 KV on the CPU)",
    )
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(
        f"decode attention, {LAYERS} layers, {HEADS} heads / {KV_HEADS} KV heads x {HEAD_DIM}, KV {args.dtype}, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}"
    )
    print("ms per step, median (wall / CPU time); mirror first step and full refill (wall)")
    print(
        f"{'batch':>5} {'context':>7} | {'old':>13} {'gather':>13} {'mirror':>13} {'first':>7} {'refill':>7} | "
        f"{'old/mirror (wall, CPU)':>22}"
    )
    results = {}
    for bsz in args.batch:
        for ctx in args.context:
            r = measure(bsz, ctx, dtype, args.steps)
            results[f"{bsz}x{ctx}"] = r
            cells = " ".join(f"{r[k]['wall_ms']:>6.1f}/{r[k]['cpu_ms']:<6.1f}" for k in KINDS)
            print(
                f"{bsz:>5} {ctx:>7} | {cells} {r['mirror']['first_ms']:>7.1f} {r['mirror']['refill_ms']:>7.1f} | "
                f"{r['old']['wall_ms'] / r['mirror']['wall_ms']:>10.1f}x {r['old']['cpu_ms'] / r['mirror']['cpu_ms']:>10.1f}x",
                flush=True,
            )
    return results


if __name__ == "__main__":
    main()
