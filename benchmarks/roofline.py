"""The machine's limits and what they mean for a model: memory bandwidth (GB/s), matmul throughput
(GFLOP/s) per dtype and batch size, and from them the bandwidth-bound decode rate at batch 1
(weight bytes read per token / bandwidth) and the compute-bound rate at large batch
(2 x weight parameters FLOPs per token / peak matmul throughput). Weights only: attention over
the KV cache and the per-step overhead are left out, so real rates sit below these ceilings
(`kv_bytes_per_step` gives the KV cache's share at a context length, for a second ceiling).

    plait bench roofline --model smollm2 --dtype float32 --quantization int8

Other benchmarks call `roofline(...)` and print their rates as a fraction of it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from plait.runtime.server_args import set_openmp_defaults

set_openmp_defaults()  # matmuls timed as the scheduler process runs them

MATMUL_MS = (1, 32, 64, 1024)
_cache: dict = {}


def _best_seconds(fn, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _huge_page_floats(n: int):
    """n float32 ones in huge pages (as plait's weights are, see weight_arena); None where the kernel
    refuses them."""
    import torch

    from plait.runtime.model_executor.weight_arena import huge_page_buffer

    raw = huge_page_buffer(n * 4)
    return None if raw is None else raw.view(torch.float32).fill_(1.0)


def _read_gbs(t, reps: int) -> float:
    """Best-of-`reps` GB/s of summing float32 `t` (torch's sum reads it on every thread)."""
    return t.numel() * t.element_size() / _best_seconds(lambda: t.sum(), reps) / 1e9


def measure_bandwidth(size_mb: int = 512, reps: int = 5) -> dict:
    """Best-of-`reps` GB/s of reading (a sum) and copying (read + write) a `size_mb` float32 tensor,
    far larger than the caches, in 4 KB pages and (where the kernel gives them) 2 MB ones: the
    hardware prefetchers stop at page boundaries, so huge pages read faster (34 vs 42 GB/s on the
    AVX2 machine). `read_gbs` / `copy_gbs`: the faster of the two, the machine's limit."""
    import torch

    n = size_mb * 2**20 // 4
    out = {}
    for pages, src in (("4k", torch.ones(n)), ("huge", _huge_page_floats(n))):
        if src is None:
            continue
        dst = torch.empty_like(src)
        out[f"read_gbs_{pages}"] = _read_gbs(src, reps)
        out[f"copy_gbs_{pages}"] = 2 * n * 4 / _best_seconds(lambda: dst.copy_(src), reps) / 1e9  # noqa: F821 (bound; del'd below)
        del src, dst
    out["read_gbs"] = max(v for k, v in out.items() if k.startswith("read"))
    out["copy_gbs"] = max(v for k, v in out.items() if k.startswith("copy"))
    return out


class BandwidthProbe:
    """A short read-bandwidth measurement (a 2-thread sum of `size_mb` in huge pages where the
    kernel gives them, best of `reps`, ~40 ms) to take next to a timed run. On a shared host the
    bandwidth a process gets drifts by a third within minutes (this probe read 18.6-25.7 GB/s
    around the rounds of one 2-second float32 run here), so a batch-1 rate is also compared with
    the bandwidth read around it, not only with the best seen at some other minute. Holds its
    buffer between measurements."""

    def __init__(self, size_mb: int = 256):
        import torch

        n = size_mb * 2**20 // 4
        buf = _huge_page_floats(n)
        self.buf = buf if buf is not None else torch.ones(n)

    def read_gbs(self, reps: int = 3) -> float:
        return _read_gbs(self.buf, reps)


def measure_matmul(kind: str, m: int, n: int = 2048, k: int = 2048, reps: int = 5) -> float:
    """GFLOP/s of `[m, k] x [k, n]` for kind float32 / bfloat16 (prepacked oneDNN when available,
    as plait runs them), int8 or int4 (plait's Int8Linear / Int4Linear)."""
    import torch

    from plait.runtime.kernels.cpu import cpu_kernels
    from plait.runtime.layers.prepack import PackedLinear, prepack_available
    from plait.runtime.layers.quantization import Int4Linear, Int8Linear

    cpu_kernels.load()  # as a model's load does: the layers below take the fused kernels where they run
    w = torch.randn(n, k) * 0.02
    if kind in ("int8", "int4"):
        layer, x = (Int8Linear if kind == "int8" else Int4Linear)(w, None), torch.randn(m, k)
    else:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[kind]
        w, x = w.to(dtype), torch.randn(m, k, dtype=dtype)
        layer = PackedLinear(w, None) if prepack_available() else torch.nn.Linear(k, n, bias=False, dtype=dtype)
        if not prepack_available():
            layer.weight.data.copy_(w)
    with torch.inference_mode():
        seconds = _best_seconds(lambda: layer(x), reps)
    return 2 * m * n * k / seconds / 1e9


def _cache_key(threads: int | None, quick: bool) -> tuple[int, bool]:
    """Sets the thread count (when given); the key of `_cache` for it."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads(), quick


def measure_machine(threads: int | None = None, quick: bool = False) -> dict:
    """Bandwidth and matmul GFLOP/s per kind and M (cached per process and thread count)."""
    key = _cache_key(threads, quick)
    if key not in _cache:
        size, ms, dim = (32, (1, 32), 256) if quick else (512, MATMUL_MS, 2048)
        machine = {"threads": key[0], **measure_bandwidth(size, reps=2 if quick else 5), "matmul_gflops": {}}
        for kind in ("float32", "bfloat16", "int8", "int4"):
            machine["matmul_gflops"][kind] = {m: measure_matmul(kind, m, dim, dim, reps=2 if quick else 5) for m in ms}
        _cache[key] = machine
    return _cache[key]


def remeasure_machine(threads: int | None = None, quick: bool = False) -> dict:
    """Measure again and keep, for every figure, the higher of this and the cached measurement: a
    shared host's neighbours can hold a whole measurement down for seconds (bandwidth seen at 19
    and 33 GB/s minutes apart), and the limit is what the machine reached."""
    before = _cache.pop(_cache_key(threads, quick), None)
    now = measure_machine(threads, quick)
    if before is not None:
        for k, v in before.items():
            if isinstance(v, float):
                now[k] = max(now.get(k, v), v)
        for kind, row in before["matmul_gflops"].items():
            for m, v in row.items():
                now["matmul_gflops"][kind][m] = max(now["matmul_gflops"][kind][m], v)
    return now


def model_costs(config, kind: str) -> dict:
    """Per decoded token: weight bytes read and FLOPs, counting the linear layers and the LM head
    (embedding lookup, norms and attention are negligible at short context or left out)."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    per_layer = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + 3 * h * inter
    params = layers * per_layer + config.vocab_size * h
    rows = layers * ((heads + 2 * kv_heads) * head_dim + h + 2 * inter + h) + config.vocab_size
    bytes_per = {"float32": 4, "bfloat16": 2, "int8": 1}.get(kind, 1)
    weight_bytes = params * bytes_per + (rows * 4 if kind == "int8" else 0)  # + one float scale per row
    if kind == "int4":  # 4 bits + a bf16 (scale, zero) per 32 weights; the LM head stays int8
        head = config.vocab_size * h
        weight_bytes = int((params - head) * (0.5 + 4 / 32)) + head + config.vocab_size * 4
    return {"linear_params": params, "bytes_per_token": weight_bytes, "flops_per_token": 2 * params}


def kv_bytes_per_step(config, context: int, kv_bytes: int) -> int:
    """Bytes of K and V one decoded token reads from a `context`-token cache (every layer)."""
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * context * kv_bytes


def _kind(model_path: str, dtype: str, quantization: str | None) -> str:
    if quantization in ("int8", "int4"):
        return quantization
    if dtype == "auto":
        import torch

        from plait.runtime.model_executor.model_loader import load_config
        from plait.runtime.model_executor.model_runner import resolve_dtype

        return str(resolve_dtype("auto", load_config(model_path), torch.device("cpu"))).removeprefix("torch.")
    return dtype


def roofline(
    model: str = "smollm2",
    dtype: str = "float32",
    quantization: str | None = None,
    threads: int | None = None,
    quick: bool = False,
) -> dict:
    """Decode ceilings for `model` on this machine: `batch1_tok_s` (bandwidth-bound) and
    `large_batch_tok_s` (compute-bound, at the best measured matmul throughput)."""
    from plait.runtime.model_executor.model_loader import load_config, resolve_model

    path = resolve_model(model)
    kind = _kind(path, dtype, quantization)
    machine = measure_machine(threads, quick)
    costs = model_costs(load_config(path), kind)
    peak = max(machine["matmul_gflops"][kind].values())
    return {
        "model": model,
        "kind": kind,
        "machine": machine,
        **costs,
        "peak_gflops": peak,
        "batch1_tok_s": machine["read_gbs"] * 1e9 / costs["bytes_per_token"],
        "large_batch_tok_s": peak * 1e9 / costs["flops_per_token"],
    }


def fraction_line(label: str, tok_s: float, limit: float) -> str:
    """`label: 12.3 tok/s = 45% of the 27.4 tok/s roofline`."""
    return f"{label}: {tok_s:.1f} tok/s = {tok_s / limit:.0%} of the {limit:.1f} tok/s roofline"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="plait bench roofline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--quantization", default=None, choices=["int8", "int4"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test, not a measurement)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    r = roofline(args.model, args.dtype, args.quantization, args.threads, args.quick)
    m = r["machine"]
    print(f"\nthreads {m['threads']}  (load avg {os.getloadavg()[0]:.2f})")
    print(
        f"memory bandwidth: read {m['read_gbs']:.1f} GB/s, copy {m['copy_gbs']:.1f} GB/s "
        f"(4 KB pages: {m['read_gbs_4k']:.1f} / {m['copy_gbs_4k']:.1f}"
        + (f"; 2 MB pages: {m['read_gbs_huge']:.1f} / {m['copy_gbs_huge']:.1f})" if "read_gbs_huge" in m else ")")
    )
    ms = sorted(next(iter(m["matmul_gflops"].values())))
    print("matmul GFLOP/s  " + "".join(f"{'M=' + str(x):>10}" for x in ms))
    for kind, row in m["matmul_gflops"].items():
        print(f"{kind:16}" + "".join(f"{row[x]:10.1f}" for x in ms))
    print(
        f"\nmodel {r['model']} as {r['kind']}: {r['linear_params'] / 1e6:.1f}M linear params, "
        f"{r['bytes_per_token'] / 2**20:.1f} MiB read and {r['flops_per_token'] / 1e9:.2f} GFLOP per token"
    )
    print(f"batch-1 decode ceiling (bandwidth): {r['batch1_tok_s']:8.1f} tok/s")
    print(f"large-batch decode ceiling (compute, {r['peak_gflops']:.0f} GFLOP/s): {r['large_batch_tok_s']:8.1f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
