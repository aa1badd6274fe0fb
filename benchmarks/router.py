"""Data-parallel routing benchmark: two `plait serve` replicas behind `plait router`, a shared-prefix
workload (many multi-turn programs over a few long prefixes), cache-aware routing vs round robin:
throughput and prefix-cache hit rate side by side.

    plait bench router --num-prefixes 4 --programs-per-prefix 8 --prefix-words 300

Each program is a conversation over one of the prefixes (a long shared document): a question,
the model's answer, a follow-up, and a second answer; every turn is one native /generate request
carrying the whole text, as a DSL program over `RuntimeEndpoint` sends it. Programs run
concurrently (at most --max-concurrency at once), in a shuffled order. The hit rate is
sum(cached_tokens) / sum(prompt_tokens) over every request's meta_info. Replica caches are
flushed before each policy's run; each policy gets a fresh router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

POLICIES = ("cache_aware", "round_robin")


@dataclass
class Program:
    prefix: str
    turns: list[str]  # the user's lines, one per generate call


@dataclass
class RunStats:
    requests: int = 0
    failed: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    duration: float = 0.0
    errors: list[str] = field(default_factory=list)
    per_replica: list[int] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        d = self.duration or float("nan")
        return {
            "requests": self.requests,
            "failed": self.failed,
            "duration_s": self.duration,
            "request_throughput": self.requests / d,
            "output_throughput": self.output_tokens / d,
            "cache_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "requests_per_replica": self.per_replica,
            "errors": self.errors[:5],
        }


def make_programs(
    words: list[str], num_prefixes: int, per_prefix: int, prefix_words: int, turns: int, seed: int
) -> list[Program]:
    """`num_prefixes` long documents of random words, `per_prefix` programs over each, shuffled."""
    rng = random.Random(seed)
    programs = []
    for k in range(num_prefixes):
        doc = f"Document {k}:\n" + " ".join(rng.choice(words) for _ in range(prefix_words)) + "\n\n"
        for j in range(per_prefix):
            asks = [
                f"Question {j}.{t}: what does the word '{rng.choice(words)}' suggest here?\nAnswer:"
                for t in range(turns)
            ]
            programs.append(Program(doc, asks))
    rng.shuffle(programs)
    return programs


async def run_program(client: httpx.AsyncClient, program: Program, output_len: int, stats: RunStats) -> None:
    """The program's turns in order, each answer appended to the text of the next turn."""
    text = program.prefix
    sampling = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    for ask in program.turns:
        text += ask
        try:
            resp = await client.post("/generate", json={"text": text, "sampling_params": sampling})
        except httpx.HTTPError as e:  # connection failures count as failed requests
            stats.failed += 1
            stats.errors.append(f"{type(e).__name__}: {e}")
            return
        if resp.status_code != 200:
            stats.failed += 1
            stats.errors.append(f"HTTP {resp.status_code}: {resp.text[:200]}")
            return
        out = resp.json()
        meta = out["meta_info"]
        stats.requests += 1
        stats.output_tokens += meta["completion_tokens"]
        stats.prompt_tokens += meta["prompt_tokens"]
        stats.cached_tokens += meta["cached_tokens"]
        text += out["text"] + "\n"


async def run_workload(base: str, programs: list[Program], output_len: int, max_concurrency: int) -> RunStats:
    stats = RunStats()
    sem = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(None, connect=30), limits=limits) as client:

        async def one(p: Program) -> None:
            async with sem:
                await run_program(client, p, output_len, stats)

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in programs))
        stats.duration = time.perf_counter() - start
        info = (await client.get("/get_server_info")).json()
        stats.per_replica = [r["routed"] for r in info["replicas"]]
    return stats


@contextlib.contextmanager
def launch_router(urls: list[str], policy: str, port: int, timeout: float = 60.0):
    """`plait router` in a subprocess; yields its base URL once /health answers."""
    cmd = [
        sys.executable,
        "-m",
        "plait.cli",
        "router",
        "--worker-urls",
        *urls,
        "--port",
        str(port),
        "--policy",
        policy,
        "--log-level",
        "warning",
    ]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"plait router exited with {proc.returncode}:\n{log.read()[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError("plait router did not become healthy")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                time.sleep(0.2)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def print_table(results: dict[str, dict[str, Any]]) -> None:
    names = list(results)
    rows = [
        ("requests (ok / failed)", lambda r: f"{r['requests']} / {r['failed']}"),
        ("duration (s)", lambda r: f"{r['duration_s']:.2f}"),
        ("request throughput (req/s)", lambda r: f"{r['request_throughput']:.2f}"),
        ("output throughput (tok/s)", lambda r: f"{r['output_throughput']:.1f}"),
        ("cache hit rate", lambda r: f"{100 * r['cache_hit_rate']:.1f}%"),
        ("requests per replica", lambda r: "/".join(map(str, r["requests_per_replica"]))),
    ]
    print(f"\n{'':28}" + "".join(f"{n:>16}" for n in names))
    for label, fmt in rows:
        print(f"{label:28}" + "".join(f"{fmt(results[n]):>16}" for n in names))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="plait bench router", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads per replica (default: the cores split between the two)",
    )
    ap.add_argument("--max-total-tokens", type=int, default=None, help="KV pool per replica")
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--programs-per-prefix", type=int, default=8)
    ap.add_argument("--prefix-words", type=int, default=300, help="words in each shared document")
    ap.add_argument("--turns", type=int, default=2, help="generate calls per program")
    ap.add_argument("--output-len", type=int, default=16, help="tokens per answer")
    ap.add_argument("--max-concurrency", type=int, default=16, help="programs running at once")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--launch-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from plait.benchmarks.serving import _free_port, _word_pool, launch_server
    from plait.runtime.model_executor.model_loader import load_tokenizer, resolve_model

    args = build_parser().parse_args(argv)
    for name in ("num_prefixes", "programs_per_prefix", "prefix_words", "turns", "output_len", "max_concurrency"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    words = _word_pool(load_tokenizer(resolve_model(args.model)))
    programs = make_programs(
        words, args.num_prefixes, args.programs_per_prefix, args.prefix_words, args.turns, args.seed
    )
    kw: dict[str, Any] = {"model": args.model, "num_threads": args.num_threads or max(1, (os.cpu_count() or 2) // 2)}
    for name in ("dtype", "max_total_tokens"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    load_before = os.getloadavg()
    print(
        f"model {args.model}, 2 replicas ({kw['num_threads']} threads each), {len(programs)} programs "
        f"({args.num_prefixes} prefixes of {args.prefix_words} words x {args.programs_per_prefix}), "
        f"{args.turns} turns of {args.output_len} tokens, concurrency {args.max_concurrency}  "
        f"(load avg {load_before[0]:.2f})",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(launch_server(kw, _free_port(), args.launch_timeout)) for _ in range(2)]
        for url in urls:  # warm-up: the first forward passes are slow; then the cache is emptied
            httpx.post(url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}, timeout=300)
        for policy in args.policies:
            for url in urls:
                httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
            with launch_router(urls, policy, _free_port()) as base:
                stats = asyncio.run(run_workload(base, programs, args.output_len, args.max_concurrency))
            results[policy] = stats.row()
            print(
                f"{policy}: {stats.requests} requests in {stats.duration:.1f} s, hit rate "
                f"{100 * results[policy]['cache_hit_rate']:.1f}%",
                flush=True,
            )
    load_after = os.getloadavg()
    print_table(results)
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    out = {
        "config": vars(args),
        "engine_args": kw,
        "results": results,
        "load_avg_before": load_before,
        "load_avg_after": load_after,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
