"""plait side by side with the peers installed here, in one run, alternating.

Workloads (`--workloads`, default all three):
- chat: greedy chat completions of exactly --output-len tokens, in waves of C requests at
  concurrency C (C in --concurrency, default 1 8 32), output tok/s;
- json: JSON-schema extraction (the `jump_forward` benchmark's documents and schema), C requests in
  flight at each C, constrained by the schema on every engine that can constrain; output tok/s and
  how many outputs validate;
- programs: the program workload of `plait bench programs` (few-shot QA, tree of thought, JSON
  extraction and multi-turn chat after a shared ~1000-token prefix). plait runs the programs with
  `run_batch` (radix cache on) and records every call they send; then the very same calls are
  replayed with --program-concurrency in flight on plait and on llama.cpp (its prompt cache on).

Engines, taking turns at each level so that a change in machine load hits all of them:
- plait (`plait.Engine`, in this process);
- HF transformers `generate`, one request at a time and statically batched (C per call; chat only:
  it has no grammar-constrained decoding);
- llama.cpp on the same GGUF, when a `llama-server` binary is on PATH (continuous batching with
  C slots) or `llama-cpp-python` is installed (its server); otherwise "llama.cpp: not found". It
  runs with OpenMP's default settings, as its users run it; HF and plait get plait's (idle threads
  spin briefly, then sleep: `set_openmp_defaults`).

Writes the results as JSON (--json) and a PNG of chat throughput against concurrency (--plot;
needs matplotlib: pip install 'plait[bench]').

    plait bench compare --output-len 64 --json compare.json --plot compare.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from plait.runtime.server_args import OPENMP_SETTINGS, set_openmp_defaults

# HF (in this process) gets the OpenMP settings of plait's scheduler process; llama.cpp runs with
# OpenMP's defaults, as its users run it (with OMP_WAIT_POLICY=PASSIVE its decode is ~3x slower here).
set_openmp_defaults()


# --- llama.cpp ------------------------------------------------------------------------------------
def gguf_for(model: str) -> str | None:
    """The GGUF file behind `model` (the bundled default's, or a .gguf path); None for HF folders."""
    from plait.runtime.model_executor import model_loader

    if model.lower() in model_loader._DEFAULT_ALIASES:
        return model_loader._bundled_smollm2_gguf()
    return model if model.lower().endswith(".gguf") and os.path.isfile(model) else None


def llama_cpp_command(gguf: str, port: int, threads: int, slots: int, ctx_per_slot: int) -> list[str] | None:
    """The command that serves `gguf` with llama.cpp, or None when llama.cpp is not installed."""
    binary = shutil.which("llama-server")
    if binary:
        return [
            binary,
            "-m",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(threads),
            "-np",
            str(slots),
            "-c",
            str(slots * ctx_per_slot),
            "-cb",
            "--log-disable",
        ]
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        return None
    # llama-cpp-python's server runs one sequence at a time.
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        str(threads),
        "--n_ctx",
        str(ctx_per_slot),
    ]


class LlamaCppServer:
    """A llama.cpp server subprocess, driven through its OpenAI-style /v1/completions."""

    def __init__(self, command: list[str], port: int, timeout: float = 300.0):
        import httpx

        self.url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if k not in OPENMP_SETTINGS}
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        self.client = httpx.Client(timeout=timeout)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited with code {self.proc.returncode}: {' '.join(command)}")
            try:
                if self.client.get(f"{self.url}/v1/models").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("llama.cpp server did not become ready")
            time.sleep(0.5)

    def complete(self, prompt: str, max_tokens: int, **extra) -> tuple[int, str]:
        """One completion (greedy, exactly `max_tokens` unless `extra` says otherwise); (tokens
        generated, text). `extra`: stop, json_schema, ignore_eos, cache_prompt ..."""
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
            **extra,
        }
        r = self.client.post(f"{self.url}/v1/completions", json=body)
        r.raise_for_status()
        out = r.json()
        return out["usage"]["completion_tokens"], out["choices"][0]["text"]

    def run(self, prompts: list[str], output_len: int, concurrency: int) -> float:
        """Output tok/s with `concurrency` requests in flight."""
        t = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(n for n, _ in pool.map(lambda p: self.complete(p, output_len), prompts))
        return tokens / (time.perf_counter() - t)

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --- the run --------------------------------------------------------------------------------------
def plait_run(engine, prompts: list[str], output_len: int, concurrency: int) -> float:
    """Output tok/s of plait with waves of `concurrency` requests."""
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    engine.flush_cache()  # every engine starts cold: no prefix reuse from an earlier level
    t = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), concurrency):
        tokens += sum(len(o["output_ids"]) for o in engine.generate(prompts[i : i + concurrency], params))
    return tokens / (time.perf_counter() - t)


def in_flight(fn, items: list, concurrency: int) -> tuple[float, list]:
    """Run `fn` on every item with at most `concurrency` calls in flight; (seconds, results)."""
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(fn, items))
    return time.perf_counter() - t, results


def run_chat(args, engine, hf, tok, llama, prompts: list[str]) -> dict:
    """The chat workload at every concurrency; {engine: {C: tok/s}}."""
    from plait.benchmarks.offline import hf_generate

    levels = sorted(args.concurrency)
    results: dict = {"plait": {}, "hf_static": {}, "hf_sequential": {}}
    if llama is not None:
        results["llama.cpp"] = {}
    for c in levels:
        batch = prompts[: c * args.waves]
        results["plait"][c] = plait_run(engine, batch, args.output_len, c)
        results["hf_static"][c] = hf_generate(hf, tok, batch, args.output_len, c)
        if llama is not None:
            results["llama.cpp"][c] = llama.run(batch, args.output_len, c)
        # HF one at a time does not depend on C: measured on a few requests, once.
        if c == levels[0]:
            k = min(args.hf_sequential, len(prompts))
            results["hf_sequential"][c] = hf_generate(hf, tok, prompts[:k], args.output_len, 1)
        print(f"  chat C={c}: " + "  ".join(f"{name} {r[c]:.1f}" for name, r in results.items() if c in r), flush=True)
    seq = next(iter(results.pop("hf_sequential").values()))
    results["hf_sequential"] = {c: seq for c in levels}
    return results


def _valid_json(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_json(args, engine, llama, tokenizer) -> dict:
    """JSON-schema extraction at every concurrency; {engine: {C: {tok_s, valid, requests}}}."""
    from plait.benchmarks.jump_forward import SCHEMA, prompts

    docs = prompts(tokenizer)
    params = {"json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": args.json_max_tokens}
    results: dict = {"plait": {}}
    if llama is not None:
        results["llama.cpp"] = {}
    for c in sorted(args.concurrency):
        batch = [docs[i % len(docs)] for i in range(max(c, len(docs)) * args.waves)]
        engine.flush_cache()
        dt, outs = in_flight(lambda text: engine.generate(text, params), batch, c)
        results["plait"][c] = {
            "tok_s": sum(o["meta_info"]["completion_tokens"] for o in outs) / dt,
            "valid": sum(_valid_json(o["text"], SCHEMA) for o in outs),
            "requests": len(outs),
        }
        if llama is not None:
            dt, outs = in_flight(
                lambda text: llama.complete(text, args.json_max_tokens, json_schema=SCHEMA, ignore_eos=False), batch, c
            )
            results["llama.cpp"][c] = {
                "tok_s": sum(n for n, _ in outs) / dt,
                "valid": sum(_valid_json(t, SCHEMA) for _, t in outs),
                "requests": len(outs),
            }
        print(
            f"  json C={c}: "
            + "  ".join(
                f"{name} {r[c]['tok_s']:.1f} tok/s ({r[c]['valid']}/{r[c]['requests']} valid)"
                for name, r in results.items()
            ),
            flush=True,
        )
    return results


def _llama_call(payload: dict) -> tuple[str, int, dict]:
    """A recorded native /generate call as llama.cpp completion arguments (prompt, max tokens, extra)."""
    sp = payload.get("sampling_params", {})
    extra: dict = {"ignore_eos": False, "cache_prompt": True, "temperature": sp.get("temperature", 0)}
    if sp.get("stop"):
        extra["stop"] = sp["stop"] if isinstance(sp["stop"], list) else [sp["stop"]]
    if sp.get("json_schema"):
        schema = sp["json_schema"]
        extra["json_schema"] = json.loads(schema) if isinstance(schema, str) else schema
    return payload["text"], sp.get("max_new_tokens", 16), extra


def run_programs(args, engine, llama) -> dict:
    """The program workload: plait's run_batch, then its recorded calls replayed on each engine."""
    from plait.benchmarks.programs import few_shot, make_batch, run_recorded

    batch = make_batch(args.num_programs, args.num_shots)
    engine.flush_cache()
    dt, calls = run_recorded(engine, batch, few_shot(args.num_shots), args.program_max_tokens, args.program_concurrency)
    calls = [c for c in calls if c.get("sampling_params", {}).get("max_new_tokens", 1) > 0]
    out = {"programs": len(batch), "calls": len(calls), "plait_run_batch_s": dt}
    engine.flush_cache()
    seconds, _ = in_flight(lambda c: engine.generate(c["text"], c["sampling_params"]), calls, args.program_concurrency)
    out["replay_s"] = {"plait": seconds}
    if llama is not None:

        def replay(call: dict) -> tuple[int, str]:
            prompt, max_tokens, extra = _llama_call(call)
            return llama.complete(prompt, max_tokens, **extra)

        seconds, _ = in_flight(replay, calls, args.program_concurrency)
        out["replay_s"]["llama.cpp"] = seconds
    print(
        f"  programs: plait run_batch {dt:.2f} s; replay of {len(calls)} calls at concurrency "
        f"{args.program_concurrency}: " + "  ".join(f"{k} {v:.2f} s" for k, v in out["replay_s"].items()),
        flush=True,
    )
    return out


def compare(args) -> dict:
    """Run the chosen workloads on every engine, alternating; returns the results and notes."""
    import plait
    from plait.benchmarks.offline import hf_generate, load_hf, make_prompts
    from plait.runtime.model_executor.model_loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model))
    prompts = make_prompts(tokenizer, max(args.concurrency) * args.waves)
    levels = sorted(args.concurrency)
    notes: list[str] = []
    llama = None
    gguf = gguf_for(args.model)
    slots = max(levels + [args.program_concurrency])
    command = (
        None
        if gguf is None or args.skip_llama_cpp
        else llama_cpp_command(gguf, args.llama_port, args.threads, slots, args.ctx_per_slot)
    )
    if args.skip_llama_cpp:
        notes.append("llama.cpp: skipped")
    elif gguf is None:
        notes.append(f"llama.cpp: no GGUF for model {args.model!r}")
    elif command is None:
        notes.append("llama.cpp: not found (no llama-server on PATH, no llama-cpp-python)")
    else:
        llama = LlamaCppServer(command, args.llama_port)
        notes.append(f"llama.cpp: {command[0]} on {gguf}")
    hf, tok = load_hf(args.model, args.dtype, args.threads) if "chat" in args.workloads else (None, None)
    out: dict = {"notes": notes}
    try:
        with plait.Engine(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            num_threads=args.threads,
            max_running_requests=slots,
            max_total_tokens=args.max_total_tokens,
        ) as engine:
            engine.generate(prompts[0], {"max_new_tokens": 2})  # warm-ups
            if hf is not None:
                hf_generate(hf, tok, prompts[:1], 2, 1)
            if "chat" in args.workloads:
                out["results"] = run_chat(args, engine, hf, tok, llama, prompts)
            if "json" in args.workloads:
                out["json"] = run_json(args, engine, llama, tokenizer)
            if "programs" in args.workloads:
                out["programs"] = run_programs(args, engine, llama)
    finally:
        if llama is not None:
            llama.close()
    return out


def print_table(out: dict) -> None:
    print(f"\nload avg {out['load_avg'][0]:.2f}")
    if "results" in out:
        print_chat(out)
    if "json" in out:
        r = out["json"]
        levels = sorted(r["plait"])
        print("\njson extraction: output tok/s (valid / requests)")
        print(f"{'engine':24}" + "".join(f"{'C=' + str(c):>18}" for c in levels))
        for name, row in r.items():
            print(
                f"{name:24}"
                + "".join(f"{row[c]['tok_s']:9.1f} ({row[c]['valid']:>2}/{row[c]['requests']:>2})" for c in levels)
            )
        for name, row in r.items():
            if name != "plait":
                print(
                    f"{'plait / ' + name:24}"
                    + "".join(f"{r['plait'][c]['tok_s'] / row[c]['tok_s']:17.2f}x" for c in levels)
                )
    if "programs" in out:
        p = out["programs"]
        print(
            f"\nprograms: {p['programs']} programs, {p['calls']} calls; plait run_batch {p['plait_run_batch_s']:.2f} s "
            f"({p['programs'] / p['plait_run_batch_s']:.2f} programs/s)"
        )
        ours = p["replay_s"]["plait"]
        for name, sec in p["replay_s"].items():
            ratio = f"  plait / {name}: {sec / ours:.2f}x" if name != "plait" else ""
            print(f"  replay on {name:12} {sec:8.2f} s  {p['programs'] / sec:6.2f} programs/s{ratio}")
    for note in out["notes"]:
        print(note)


def print_chat(out: dict) -> None:
    r = out["results"]
    levels = sorted(r["plait"])
    print("chat: output tok/s")
    print(f"{'engine':24}" + "".join(f"{'C=' + str(c):>10}" for c in levels))
    for name, row in r.items():
        print(f"{name:24}" + "".join(f"{row[c]:10.1f}" for c in levels))
    print("\nratio plait / peer")
    for name, row in r.items():
        if name != "plait":
            print(f"{'plait / ' + name:24}" + "".join(f"{r['plait'][c] / row[c]:9.2f}x" for c in levels))
    if "roofline" in out:
        from plait.benchmarks.roofline import fraction_line

        roof = out["roofline"]
        print(
            fraction_line(f"plait at C={levels[0]} vs batch-1 bandwidth", r["plait"][levels[0]], roof["batch1_tok_s"])
        )
        print(
            fraction_line(
                f"plait at C={levels[-1]} vs large-batch compute", r["plait"][levels[-1]], roof["large_batch_tok_s"]
            )
        )


def plot(out: dict, path: str) -> bool:
    """Throughput against concurrency, one line per engine; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    if "results" not in out:
        return True
    for name, row in out["results"].items():
        levels = sorted(row)
        ax.plot(levels, [row[c] for c in levels], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    c = out["config"]
    weights = f"plait {c['quantization']} weights, " if c.get("quantization") else ""
    ax.set_title(f"{c['model']} ({weights}{c['dtype']}, {c['threads']} threads)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="plait bench compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default=None, choices=["int8", "int4"], help="plait's weights (HF stays float)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--waves", type=int, default=1, help="waves of C requests per level")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--hf-sequential", type=int, default=2, help="requests HF runs one at a time")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--llama-port", type=int, default=30901)
    ap.add_argument(
        "--ctx-per-slot",
        type=int,
        default=2048,
        help="llama.cpp context per slot (the program prompts are ~1,300 tokens)",
    )
    ap.add_argument(
        "--workloads", nargs="+", default=["chat", "json", "programs"], choices=["chat", "json", "programs"]
    )
    ap.add_argument("--json-max-tokens", type=int, default=160, help="max new tokens of a JSON extraction")
    ap.add_argument("--num-programs", type=int, default=16, help="programs of the program workload")
    ap.add_argument("--num-shots", type=int, default=10, help="worked examples in the programs' shared prefix")
    ap.add_argument("--program-max-tokens", type=int, default=16, help="max new tokens of each gen in a program")
    ap.add_argument("--program-concurrency", type=int, default=16, help="programs (replayed calls) in flight")
    ap.add_argument("--skip-roofline", action="store_true")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write a PNG of throughput against concurrency here")
    args = ap.parse_args(argv)
    if min(args.concurrency) < 1 or args.waves < 1 or args.output_len < 1:
        ap.error("--concurrency, --waves and --output-len must be >= 1")
    out = {"config": vars(args), **compare(args)}
    out["load_avg"] = os.getloadavg()
    if not args.skip_roofline:
        from plait.benchmarks.roofline import roofline

        r = roofline(args.model, args.dtype, args.quantization, args.threads)
        out["roofline"] = {k: r[k] for k in ("batch1_tok_s", "large_batch_tok_s", "peak_gflops")}
    print_table(out)
    if args.plot and not plot(out, args.plot):
        print("plot skipped: matplotlib is not installed (pip install 'plait[bench]')")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
