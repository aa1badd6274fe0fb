"""The hand-written API schema corpus (tests/schema_corpus.py) through plait.Engine, per grammar backend.

Reports, for one backend:
- compile: how many schemas compile, and compile time p50 / p99 / max measured directly with
  `plait.grammar.make_backend(...).compile(spec)` on the model's tokenizer (cold: no cache), with a
  per-schema limit (--compile-timeout; outlines builds its index in a child process and is killed
  at the limit);
- sampled outputs: every schema x --seeds seeds at temperature 1.0, all sent as one batch; how many
  finished, parsed, validated (jsonschema, the corpus' format checker: the syntax the backends
  enforce), were cut by max_new_tokens (finish reason length), were aborted (compile failure),
  and how many more only fail a calendar check (2023-02-29);
- decode throughput, constrained vs unconstrained, at concurrency 1 and 32 (output tokens/s
  over the batch): greedy, the same prompts; the constrained run stops where the grammar ends, the
  unconstrained run (ignore_eos) is given exactly as many tokens per request as its constrained
  twin produced, so that both runs generate the same number of tokens. With the engine's
  jump-forward off the two differ only by the grammar work (mask fill, mask apply, accept); with it
  on (the default) the constrained run also gets grammar-forced tokens without a decode step each.
  --jump-forward both (the default) measures both, with two engines. Grammars are compiled before
  the timed runs (the engine's grammar cache is warm), the prefix cache is flushed before each run,
  and constrained / unconstrained runs are interleaved (the machine may be shared).

    python -m benchmarks.grammar_corpus --backend xgrammar --seeds 3 --json out.json
    python -m benchmarks.grammar_corpus --backend outlines --compile-timeout 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.join(_HERE, "..", "tests")


def _corpus():
    if _TESTS not in sys.path:
        sys.path.insert(0, _TESTS)
    import schema_corpus

    return schema_corpus


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


def measure_compile(
    backend_name: str, tokenizer, vocab_size: int, eos_ids: list[int], schemas, timeout_s: float, max_memory_mb: int
) -> dict:
    """Cold compile of every schema with a fresh backend (no cache): times and failures."""
    from plait.grammar import GrammarCache, GrammarError, GrammarSpec, make_backend

    opts: dict[str, Any] = {}
    if backend_name == "outlines":
        opts.update(compile_timeout_s=timeout_s, max_memory_mb=max_memory_mb)
    t0 = time.perf_counter()
    backend = make_backend(backend_name, tokenizer, vocab_size, eos_token_ids=eos_ids, **opts)
    setup_s = time.perf_counter() - t0
    times, failures = {}, {}
    for name, schema in schemas:
        spec = GrammarSpec.from_json_schema(schema)
        t0 = time.perf_counter()
        try:
            backend.compile(spec, timeout_s=timeout_s)
            times[name] = time.perf_counter() - t0
        except GrammarError as e:
            failures[name] = f"{time.perf_counter() - t0:.2f}s {str(e)[:200]}"
    ts = list(times.values())
    # cached: what a request for an already-seen schema pays (canonicalizing the spec + cache lookup)
    cache = GrammarCache(backend, compile_timeout_s=timeout_s)
    ok = [schema for name, schema in schemas if name in times]
    for schema in ok:
        cache.get(GrammarSpec.from_json_schema(schema), timeout=timeout_s * 3)
    cached = []
    for schema in ok:
        t0 = time.perf_counter()
        cache.get(GrammarSpec.from_json_schema(schema))
        cached.append(time.perf_counter() - t0)
    cache.shutdown()
    return {
        "setup_s": setup_s,
        "compiled": len(times),
        "failures": failures,
        "times": times,
        "compile_p50_ms": statistics.median(ts) * 1000 if ts else float("nan"),
        "compile_p99_ms": percentile(ts, 99) * 1000,
        "compile_max_ms": max(ts) * 1000 if ts else float("nan"),
        "cached_p50_us": statistics.median(cached) * 1e6 if cached else float("nan"),
        "cached_p99_us": percentile(cached, 99) * 1e6,
    }


def run_corpus(engine, schemas, seeds: int, max_new_tokens: int, temperature: float = 1.0) -> dict:
    """Every schema x seeds in ONE batch; classify each output."""
    sc = _corpus()
    prompts, params, owners = [], [], []
    for name, schema in schemas:
        for seed in range(seeds):
            prompts.append(sc.prompt_for(engine.tokenizer, name))
            params.append(
                {
                    "json_schema": schema,
                    "temperature": temperature,
                    "seed": 1000 + seed,
                    "max_new_tokens": max_new_tokens,
                }
            )
            owners.append((name, schema, seed))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    counts = {"valid": 0, "length": 0, "abort": 0, "not_json": 0, "invalid": 0, "calendar_invalid": 0, "length_free": 0}
    problems, lengths = [], []
    for (name, schema, seed), out in zip(owners, outs):
        status, detail = sc.check_output(schema, out)
        counts[status] += 1
        if status == "valid":
            lengths.append(out["meta_info"]["completion_tokens"])
            if sc.check_output(schema, out, strict=True)[0] != "valid":
                counts["calendar_invalid"] += 1
        else:
            if status == "length":
                detail = out["text"][:240]
                counts["length_free"] += sc.free_length(schema)
            problems.append({"schema": name, "seed": seed, "status": status, "detail": detail[:300]})
    return {
        "outputs": len(outs),
        **counts,
        "wall_s": wall,
        "tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
        "valid_len_p50": statistics.median(lengths) if lengths else float("nan"),
        "valid_len_max": max(lengths) if lengths else 0,
        "problems": problems,
    }


def _timed(engine, prompts, params) -> tuple[list[dict], float]:
    """One batch (or one request) from an empty prefix cache; its results and wall time."""
    engine.flush_cache()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return (outs if isinstance(outs, list) else [outs]), time.perf_counter() - t0


def throughput(engine, schemas, concurrency: int, num_requests: int, max_new_tokens: int) -> dict:
    """Constrained (greedy, schema) vs unconstrained (greedy, ignore_eos, the same token counts).

    The machine may be shared, so the two are interleaved: at concurrency 1 each request runs
    constrained then unconstrained; at concurrency C each batch of C runs in the order
    constrained, unconstrained, unconstrained, constrained and both times are summed."""
    sc = _corpus()
    chosen = [schemas[i % len(schemas)] for i in range(num_requests)]
    prompts = [sc.prompt_for(engine.tokenizer, name) for name, _ in chosen]
    tok = {"c": 0, "u": 0}
    wall = {"c": 0.0, "u": 0.0}

    def run(kind, ps, qs):
        outs, dt = _timed(engine, ps if len(ps) > 1 else ps[0], qs if len(qs) > 1 else qs[0])
        tok[kind] += sum(o["meta_info"]["completion_tokens"] for o in outs)
        wall[kind] += dt
        return outs

    for i in range(0, num_requests, concurrency):
        ps = prompts[i : i + concurrency]
        cq = [
            {"json_schema": s, "temperature": 0, "max_new_tokens": max_new_tokens}
            for _, s in chosen[i : i + concurrency]
        ]
        couts = run("c", ps, cq)
        uq = [
            {"temperature": 0, "max_new_tokens": max(1, o["meta_info"]["completion_tokens"]), "ignore_eos": True}
            for o in couts
        ]
        run("u", ps, uq)
        if concurrency > 1:
            run("u", ps, uq)
            run("c", ps, cq)
    return {
        "concurrency": concurrency,
        "requests": num_requests,
        "constrained_tokens": tok["c"],
        "constrained_s": wall["c"],
        "constrained_tok_s": tok["c"] / wall["c"],
        "unconstrained_tokens": tok["u"],
        "unconstrained_s": wall["u"],
        "unconstrained_tok_s": tok["u"] / wall["u"],
        "ratio": (tok["c"] / wall["c"]) / (tok["u"] / wall["u"]),
    }


def run(args) -> dict:
    import dataclasses

    from transformers import AutoTokenizer

    import plait
    from plait.runtime.model_executor.model_loader import resolve_model
    from plait.runtime.server_args import ServerArgs

    sc = _corpus()
    schemas = list(sc.SCHEMAS)
    if args.limit:
        schemas = schemas[: args.limit]
    result: dict[str, Any] = {
        "backend": args.backend,
        "schemas": len(schemas),
        "seeds": args.seeds,
        "max_new_tokens": args.max_new_tokens,
    }
    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine_args = dict(
        model=args.model,
        dtype=args.dtype,
        grammar_backend=args.backend,
        grammar_compile_timeout=args.compile_timeout,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=max(32, len(schemas) * args.seeds),
    )
    has_jf = "disable_jump_forward" in {f.name for f in dataclasses.fields(ServerArgs)}
    modes = [True, False] if (args.jump_forward == "both" and has_jf) else [args.jump_forward != "off"]
    result["throughput"] = []
    ok: list = []
    for jf in modes:
        extra = {"disable_jump_forward": not jf} if has_jf else {}
        with plait.Engine(**engine_args, **extra) as engine:
            if "corpus" not in result:
                eos = sorted(engine.eos_token_ids)
                vocab = engine._info["vocab_size"]
                print(f"# {args.backend}: cold compile of {len(schemas)} schemas", file=sys.stderr, flush=True)
                result["compile"] = measure_compile(
                    args.backend, tokenizer, vocab, eos, schemas, args.compile_timeout, args.max_memory_mb
                )
                print(
                    f"# {args.backend}: {len(schemas)} x {args.seeds} sampled outputs in one batch "
                    f"(jump-forward {'on' if jf else 'off'})",
                    file=sys.stderr,
                    flush=True,
                )
                result["corpus"] = run_corpus(engine, schemas, args.seeds, args.max_new_tokens)
                result["corpus"]["jump_forward"] = jf
                failed = set(result["compile"]["failures"]) | {
                    p["schema"] for p in result["corpus"]["problems"] if p["status"] == "abort"
                }
                ok = [(n, s) for n, s in schemas if n not in failed]
            else:  # a fresh engine: compile what the timed runs use first
                engine.generate(
                    [sc.prompt_for(engine.tokenizer, n) for n, _ in ok],
                    [{"json_schema": s, "max_new_tokens": 1} for _, s in ok],
                )
            for c, n in ((1, args.requests_c1), (32, args.requests_c32)):
                if not n or not ok:
                    continue
                print(
                    f"# {args.backend}: throughput at concurrency {c} ({n} requests), jump-forward "
                    f"{'on' if jf else 'off'}",
                    file=sys.stderr,
                    flush=True,
                )
                t = throughput(engine, ok, c, n, args.max_new_tokens)
                t["jump_forward"] = jf if has_jf else None
                result["throughput"].append(t)
            result["kv_slots_in_use"] = engine.kv_slots_in_use()
    return result


def print_report(r: dict) -> None:
    c, k = r["compile"], r["corpus"]
    print(f"\n## {r['backend']}: {r['schemas']} schemas x {r['seeds']} seeds, max_new_tokens {r['max_new_tokens']}")
    print(
        "| schemas compiled | outputs | valid | cut by length (of which in a free-length format schema) | aborted | not JSON | invalid | "
        "valid but calendar-invalid date | compile p50 ms | compile p99 ms | compile max ms | cached p50 / p99 us | "
        "batch wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {c['compiled']}/{r['schemas']} | {k['outputs']} | {k['valid']} | {k['length']} ({k['length_free']}) | {k['abort']} | "
        f"{k['not_json']} | {k['invalid']} | {k['calendar_invalid']} | {c['compile_p50_ms']:.1f} | "
        f"{c['compile_p99_ms']:.1f} | {c['compile_max_ms']:.1f} | "
        f"{c['cached_p50_us']:.0f} / {c['cached_p99_us']:.0f} | "
        f"{k['wall_s']:.1f} |"
    )
    if r["throughput"]:
        print("\n| concurrency | jump-forward | requests | tokens | constrained tok/s | unconstrained tok/s | ratio |")
        print("|---|---|---|---|---|---|---|")
        for t in r["throughput"]:
            jf = {True: "on", False: "off", None: "n/a"}[t.get("jump_forward")]
            print(
                f"| {t['concurrency']} | {jf} | {t['requests']} | {t['constrained_tokens']} | "
                f"{t['constrained_tok_s']:.1f} | {t['unconstrained_tok_s']:.1f} | {t['ratio']:.2f} |"
            )
    if c["failures"]:
        print("\ncompile failures:")
        for name, msg in c["failures"].items():
            print(f"  {name}: {msg}")
    if k["problems"]:
        print("\noutputs that are not valid:")
        for p in k["problems"]:
            print(f"  {p['schema']} seed {p['seed']}: {p['status']}: {p['detail'][:200]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto", choices=["auto", "xgrammar", "llguidance", "outlines"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", dest="json_out", default=None, help="write the full result here")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--compile-timeout", type=float, default=10.0, help="seconds per schema (engine and direct)")
    ap.add_argument("--max-memory-mb", type=int, default=2048, help="outlines: per-compile memory limit")
    ap.add_argument("--requests-c1", type=int, default=8, help="requests for the concurrency-1 run (0: skip)")
    ap.add_argument("--requests-c32", type=int, default=32, help="requests for the concurrency-32 run (0: skip)")
    ap.add_argument(
        "--jump-forward",
        choices=["on", "off", "both"],
        default="both",
        help="throughput with the engine's jump-forward on, off, or both (two engines)",
    )
    ap.add_argument("--limit", type=int, default=None, help="only the first N schemas")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    r = run(args)
    r["wall_s"] = time.perf_counter() - t0
    print_report(r)
    print(f"\nwall {r['wall_s']:.0f} s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(r, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
