"""Where a decode step's time goes: the scheduler's own CPU work vs the model forward.

Drives a `Scheduler` in-process: `batch` requests with `prompt-len`-token prompts are prefilled,
then `steps` decode steps are timed. Per step: the whole `step()`, the model forward inside it
(`runner.forward`, wrapped), making its batch (built, or the step before's advanced: `(batch)`), and the
rest (scheduling, sampling, outputs).
`--backend` swaps the attention backend to compare (old = the pre-mirror gather backend).
`--breakdown` also times the parts of the fused decode op (`decode_layers_`: norms, projections,
attention, ...) and prints each projection's weight stream in GB/s. Batch 1 is also compared with
the read bandwidth measured around each of `--paired-rounds` rounds of its steps (on a shared host
that bandwidth drifts by a third within minutes; the roofline line keeps the best measured).

    plait bench step_profile [--batch 1 8 32] [--prompt-len 512] [--steps 8] [--backend mirror old]
    plait bench step_profile --dtype float32 --quantization none int8 int4   # weights compared, one run
    plait bench step_profile --dtype bfloat16 --quantization int4 --batch 1 --breakdown
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from plait.runtime.server_args import KV_CACHE_DTYPE_CHOICES, ServerArgs, set_openmp_defaults

set_openmp_defaults()  # as the scheduler process has them


class Timer:
    """Accumulates the wall time of calls to a wrapped function."""

    def __init__(self, fn):
        self.fn, self.total, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - t
            self.calls += 1


def make_backend(name: str, pool):
    from plait.runtime.model_executor.attention import MirroredAttention, TorchNativeAttention

    from .attention import OldGatherAttention

    if name == "mirror":  # the pool here is sized to the workload, a server's is much larger
        return MirroredAttention(pool, mirror_budget_bytes=1 << 40)
    return {"old": OldGatherAttention, "gather": TorchNativeAttention}[name](pool)


def profile(
    sched, batch: int, prompt_len: int, steps: int, seed: int = 0, breakdown: bool = False, probe=None, rounds: int = 1
) -> dict:
    """Prefill `batch` requests, then time `steps` decode steps; ms per step for each part (and,
    with `breakdown`, per part of the fused decode op where it ran: `parts_ms`, `fused_steps`).
    With a `probe` (roofline.BandwidthProbe) the steps run in `rounds` rounds with the read
    bandwidth measured before the first and after each: `paired`, (ms per step, mean GB/s of the
    measurements around it) per round."""
    from plait.runtime.kernels.cpu import cpu_kernels
    from plait.runtime.request import GenerateInput
    from plait.runtime.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = sched.runner.vocab_size
    # Long enough that no request finishes while the last ones are still prefilling.
    prefill_steps = -(-batch * prompt_len // sched.args.chunked_prefill_size) + batch
    for i in range(batch):
        ids = [rng.randrange(100, vocab) for _ in range(prompt_len)]
        params = SamplingParams(max_new_tokens=prefill_steps + steps + 2, temperature=0, ignore_eos=True)
        sched.add_request(GenerateInput(rid=f"r{i}", input_ids=ids, params=params, seed=i))
    while sched.waiting or sched.chunked is not None:
        sched.step()
    if len(sched.running) != batch:
        raise RuntimeError(f"only {len(sched.running)} of {batch} requests are decoding; is the KV pool too small?")
    sched.step()  # first decode step: the mirror fills
    forward = Timer(sched.runner.forward)
    build, repeat = Timer(sched._build_batch), Timer(sched._repeat_batch)  # the batch: built, or advanced
    sched.runner.forward, sched._build_batch, sched._repeat_batch = forward, build, repeat
    timing_parts = breakdown and cpu_kernels.decode_profile_start()
    rounds = max(1, min(rounds, steps)) if probe is not None else 1
    paired, total, cpu = [], 0.0, 0.0
    try:
        before = probe.read_gbs() if probe is not None else None
        for r in range(rounds):
            n = steps * (r + 1) // rounds - steps * r // rounds
            t, c = time.perf_counter(), time.process_time()
            for _ in range(n):
                sched.step()
            seconds = time.perf_counter() - t
            total, cpu = total + seconds, cpu + time.process_time() - c
            if probe is not None:
                after = probe.read_gbs()
                paired.append((1000 * seconds / n, (before + after) / 2))
                before = after
    finally:
        del sched.runner.forward, sched._build_batch, sched._repeat_batch
        fused, parts = cpu_kernels.decode_profile_stop() if timing_parts else (0, {})
    for rid in [r.rid for r in sched.running]:
        sched.abort_request(rid)
    ms = 1000 / steps
    out = {
        "step_ms": total * ms,
        "forward_ms": forward.total * ms,
        "build_ms": (build.total + repeat.total) * ms,
        "scheduler_ms": (total - forward.total) * ms,
        "step_cpu_ms": cpu * ms,
    }
    if paired:
        out["paired"] = paired
    if fused:
        out.update(
            fused_steps=fused,
            parts_ms={k: 1000 * v / fused for k, v in parts.items()},
            projection_bytes=projection_bytes(sched.runner.model, batch, sched.runner.dtype),
        )
    return out


def projection_bytes(model, rows: int, dtype) -> dict[str, int]:
    """Bytes each kind of projection streams in a decode step of `rows` rows, all layers: the
    tensors its `decode_kernel` hands the fused op (weights and their bias or scales)."""
    out = {}
    for layer in model.layers:
        for name, proj in (
            ("qkv", layer.self_attn.qkv_proj),
            ("o", layer.self_attn.o_proj),
            ("gate_up", layer.mlp.gate_up_proj),
            ("down", layer.mlp.down_proj),
        ):
            spec = proj.decode_kernel(rows, dtype) if hasattr(proj, "decode_kernel") else None
            if spec is None:
                return {}
            out[name] = out.get(name, 0) + sum(t.numel() * t.element_size() for t in spec[1:3] if t is not None)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="plait bench step_profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--backend", nargs="+", default=["mirror"], choices=["mirror", "gather", "old"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--enable-torch-compile", action="store_true")
    ap.add_argument(
        "--quantization",
        nargs="+",
        default=["none"],
        choices=["none", "int8", "int4", "fp8"],
        help="weights; several: one scheduler each, their steps interleaved batch by batch",
    )
    ap.add_argument("--skip-roofline", action="store_true", help="do not measure the machine's limits")
    ap.add_argument(
        "--breakdown", action="store_true", help="time the fused decode op's parts (norms, projections, attention, ...)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="the roofline at small sizes (a smoke test, not a measurement)"
    )
    ap.add_argument(
        "--paired-rounds",
        type=int,
        default=8,
        help="batch 1: the steps in this many rounds, the read bandwidth measured around each (0: off)",
    )
    args = ap.parse_args(argv)
    from plait.runtime.scheduler.scheduler import Scheduler

    batches = sorted(args.batch)
    scheds = {}
    # Room for every request's prompt and max_new_tokens (profile() asks for enough tokens to outlast
    # the prefill: up to about 2 x batch + steps), which admission reserves.
    tokens = max(batches) * (args.prompt_len + 2 * max(batches) + args.steps + 16) + 4096
    for quant in args.quantization:
        sargs = ServerArgs(
            model=args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            num_threads=args.threads,
            max_running_requests=max(batches),
            max_total_tokens=tokens,
            enable_torch_compile=args.enable_torch_compile,
            quantization=None if quant == "none" else quant,
        )
        scheds[quant] = Scheduler(sargs)
    runner = next(iter(scheds.values())).runner
    probe = None
    if not args.skip_roofline:  # once before the steps, once after (print_fractions): the better
        from .roofline import BandwidthProbe, measure_machine

        measure_machine(args.threads, args.quick)
        if args.paired_rounds > 0 and 1 in batches:
            probe = BandwidthProbe(16 if args.quick else 256)
    print(
        f"decode step profile: {args.model} ({runner.dtype}, KV {runner.kv_dtype}), prompts of "
        f"{args.prompt_len} tokens, {args.steps} steps, "
        f"torch.compile {'on' if args.enable_torch_compile else 'off'}, load {os.getloadavg()[0]:.2f}"
    )
    print("ms per decode step (wall; 'CPU' is the process's CPU time, steadier on a loaded machine)")
    print(
        f"{'backend':>7} {'weights':>7} {'batch':>5} | {'step ms':>8} {'forward':>8} {'sched':>7} {'(batch)':>8} | "
        f"{'sched %':>7} | {'step CPU':>8}"
    )
    results = {}
    for name in args.backend:
        for sched in scheds.values():
            backend = make_backend(name, sched.runner.pool)
            if args.enable_torch_compile:  # as ModelRunner does: attention stays eager
                import torch

                backend.forward = torch.compiler.disable(backend.forward)
            sched.runner.backend = backend
        for b in batches:
            for quant, sched in scheds.items():  # interleaved: the machine's load drifts less between them
                sched.flush_cache()
                r = profile(
                    sched,
                    b,
                    args.prompt_len,
                    args.steps,
                    seed=b,
                    breakdown=args.breakdown,
                    probe=probe if b == 1 else None,
                    rounds=args.paired_rounds,
                )
                results[f"{name}/{b}" if len(scheds) == 1 else f"{name}/{quant}/{b}"] = r
                share = 100 * r["scheduler_ms"] / r["step_ms"]
                print(
                    f"{name:>7} {quant:>7} {b:>5} | {r['step_ms']:>8.1f} {r['forward_ms']:>8.1f} "
                    f"{r['scheduler_ms']:>7.2f} {r['build_ms']:>8.2f} | {share:>6.1f}% | {r['step_cpu_ms']:>8.1f}",
                    flush=True,
                )
        print(f"(load {os.getloadavg()[0]:.2f})")
    if args.breakdown:
        print_breakdown(results)
    if not args.skip_roofline:
        print_fractions(args, scheds, results)
    return results


def print_breakdown(results: dict) -> None:
    """The fused decode op's parts, ms per step, and each projection's weight stream in GB/s; then
    the rest of the forward (embedding, LM head, sampling's logits) and the scheduler's share."""
    from plait.runtime.kernels.cpu.cpu_kernels import DECODE_PARTS

    rows = {k: r for k, r in results.items() if r.get("fused_steps")}
    if not rows:
        print("\n--breakdown: no step ran the fused decode op (kernels off, or a layer it does not run)")
        return
    print("\nthe fused decode op's parts, ms per step (projections: GB/s of their weights), then the rest")
    print(
        f"{'run':>18} | "
        + " ".join(f"{p:>13}" for p in DECODE_PARTS)
        + f" | {'layers':>7} {'rest fwd':>8} {'sched':>6}"
    )
    for key, r in rows.items():
        cells = []
        for part in DECODE_PARTS:
            ms, nbytes = r["parts_ms"][part], r["projection_bytes"].get(part)
            cells.append(f"{ms:6.3f}" + (f" ({nbytes / ms / 1e6:4.1f})" if nbytes and ms > 0 else " " * 7))
        layers = sum(r["parts_ms"].values())
        print(
            f"{key:>18} | "
            + " ".join(f"{c:>13}" for c in cells)
            + f" | {layers:7.3f} {r['forward_ms'] - layers:8.3f} {r['scheduler_ms']:6.3f}"
        )


def print_fractions(args, scheds: dict, results: dict) -> None:
    """Each row's decode rate as a fraction of the roofline: batch 1 against the bandwidth ceiling
    (weights only, and weights plus the KV cache read at this context), larger batches against
    the compute one."""
    from .roofline import fraction_line, kv_bytes_per_step, remeasure_machine, roofline

    remeasure_machine(args.threads, args.quick)
    print("\nagainst the roofline (plait bench roofline; the better of two measurements, before and after):")
    for quant, sched in scheds.items():
        dtype = str(sched.runner.dtype).removeprefix("torch.")
        r = roofline(args.model, dtype, None if quant == "none" else quant, args.threads, args.quick)
        context = args.prompt_len + args.steps // 2  # the mean over the timed steps
        kv = kv_bytes_per_step(sched.runner.config, context, sched.runner.pool.k[0].element_size())
        with_kv = r["machine"]["read_gbs"] * 1e9 / (r["bytes_per_token"] + kv)
        for key, res in results.items():
            parts = key.split("/")
            if len(scheds) > 1 and parts[1] != quant:
                continue
            batch = int(parts[-1])
            tok_s = 1000 * batch / res["step_ms"]
            label = f"{parts[0]} {r['kind']} batch {batch}"
            if batch == 1:
                print(
                    f"{fraction_line(label, tok_s, r['batch1_tok_s'])} (weights); "
                    f"{tok_s / with_kv:.0%} of {with_kv:.1f} with the {context}-token KV cache"
                )
                if res.get("paired"):
                    print("  " + paired_line(res["paired"], r["bytes_per_token"], kv))
            else:
                print(fraction_line(label, tok_s, r["large_batch_tok_s"]))


def paired_line(paired: list[tuple[float, float]], weight_bytes: int, kv_bytes: int) -> str:
    """Batch 1 against the bandwidth read around each round: the median fraction (and range) of
    the rounds, weights only and with the KV cache."""

    def fractions(nbytes: int) -> list[float]:
        return sorted(nbytes / (ms / 1000) / (gbs * 1e9) for ms, gbs in paired)

    weights, with_kv = fractions(weight_bytes), fractions(weight_bytes + kv_bytes)
    gbs = [g for _, g in paired]
    return (
        f"paired: {statistics.median(weights):.0%} ({weights[0]:.0%}-{weights[-1]:.0%}) of the bandwidth read "
        f"around each of {len(paired)} rounds ({min(gbs):.1f}-{max(gbs):.1f} GB/s; weights); "
        f"{statistics.median(with_kv):.0%} with the KV cache"
    )


if __name__ == "__main__":
    main()
