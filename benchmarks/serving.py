"""Online serving benchmark, in the spirit of SGLang's `bench_serving`: synthetic prompts of chosen
lengths sent to a plait (or SGLang-compatible) server as streaming native `/generate` requests,
either all at once, at a Poisson request rate, or at a bounded concurrency. Measures TTFT,
inter-token latency and end-to-end latency per request from the SSE events, and throughput.

    plait bench serving --launch --model smollm2 --dtype float32 \\
        --num-prompts 64 --max-concurrency 32 --input-len 128 --output-len 64
    plait bench serving --base-url http://127.0.0.1:30000 --request-rate 4
    plait bench serving --launch --compare-engine ...   # the same load through plait.Engine in-process

Prompts are token ids (so the lengths are exact) made with the model's tokenizer from random
words; requests carry `ignore_eos` so every request generates exactly its output length.
`--compare-engine` runs the same prompts, at the same concurrency / rate, through
`plait.Engine.async_generate(stream=True)` with the same engine arguments (after the launched
server has stopped, so the two never share the CPU) and prints the HTTP overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# CLI option -> ServerArgs field, passed to `plait serve` and to `plait.Engine`.
ENGINE_OPTIONS = (
    "dtype",
    "device",
    "context_length",
    "max_total_tokens",
    "chunked_prefill_size",
    "max_running_requests",
    "schedule_policy",
    "disable_radix_cache",
    "num_threads",
    "random_seed",
)


# --- workload -----------------------------------------------------------------------------------
@dataclass
class Prompt:
    input_ids: list[int]
    output_len: int


def _word_pool(tokenizer, size: int = 4000) -> list[str]:
    """Plain alphabetic words from the tokenizer's vocabulary (stable order)."""
    words = []
    for tok in sorted(tokenizer.get_vocab(), key=lambda t: tokenizer.convert_tokens_to_ids(t)):
        w = tok.lstrip("Ġ▁ ")
        if 3 <= len(w) <= 10 and w.isascii() and w.isalpha():
            words.append(w)
        if len(words) >= size:
            break
    return words or ["hello", "world", "serving", "benchmark", "token"]


def sample_lengths(rng: random.Random, n: int, length: int, ratio: float) -> list[int]:
    """Lengths uniform in [max(1, length * ratio), length]; ratio 1.0 gives exactly `length`."""
    lo = max(1, int(length * ratio))
    return [rng.randint(lo, length) if lo < length else length for _ in range(n)]


def make_prompts(tokenizer, num: int, input_len: int, output_len: int, ratio: float, seed: int) -> list[Prompt]:
    """`num` prompts of random words, cut to exactly their sampled token length."""
    rng = random.Random(seed)
    words = _word_pool(tokenizer)
    in_lens = sample_lengths(rng, num, input_len, ratio)
    out_lens = sample_lengths(rng, num, output_len, ratio)
    prompts = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids: list[int] = []
        while len(ids) < n_in:
            text = " ".join(rng.choice(words) for _ in range(n_in + 8))
            ids += tokenizer(text, add_special_tokens=not ids).input_ids
        prompts.append(Prompt(ids[:n_in], n_out))
    return prompts


def sampling_params(p: Prompt) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": p.output_len, "ignore_eos": True}


# --- one request's measurements -------------------------------------------------------------------
@dataclass
class Output:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # one gap per generated token after the first
    start: float = 0.0
    finish: dict | None = None
    _last_t: float = 0.0
    _seen: int = 0

    def observe(self, event: dict) -> None:
        """Account one cumulative result event (native protocol shape)."""
        now = time.perf_counter()
        n = len(event.get("output_ids") or ())
        self.add_event(now, self._last_t or self.start, n - self._seen)
        if n > self._seen:
            self._last_t, self._seen = now, n
        self.finish = event["meta_info"].get("finish_reason") or self.finish

    def close(self) -> None:
        """The stream ended: latency, and success unless it ended without a finish or aborted."""
        self.latency = time.perf_counter() - self.start
        self.success = self.finish is not None and self.finish.get("type") != "abort"
        if not self.success:
            self.error = f"finish_reason {self.finish}"

    def add_event(self, now: float, last_t: float, new_tokens: int) -> None:
        """A stream event that carries `new_tokens` more tokens arrived at `now`. The first
        token's arrival is the TTFT; a later event carrying k tokens adds k gaps of (gap / k)."""
        if new_tokens <= 0:
            return
        if self.output_len == 0:
            self.ttft = now - self.start
            new_tokens -= 1
            self.output_len = 1
        if new_tokens > 0:
            gap = (now - last_t) / new_tokens
            self.itl += [gap] * new_tokens
            self.output_len += new_tokens


async def _sse_lines(resp) -> AsyncIterator[str]:
    async for line in resp.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


async def send_http(client, prompt: Prompt) -> Output:
    """One streaming native /generate request."""
    out = Output(prompt_len=len(prompt.input_ids), start=time.perf_counter())
    body = {"input_ids": prompt.input_ids, "sampling_params": sampling_params(prompt), "stream": True}
    try:
        async with client.stream("POST", "/generate", json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return out
            async for data in _sse_lines(resp):
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = str(event["error"].get("message"))
                    return out
                out.observe(event)
        out.close()
    except Exception as e:  # connection refused / reset, timeouts, bad JSON
        out.error = f"{type(e).__name__}: {e}"
    return out


def engine_sender(engine) -> Callable[[Prompt], Awaitable[Output]]:
    """The same request through an in-process plait.Engine (`async_generate(stream=True)`)."""

    async def send(prompt: Prompt) -> Output:
        out = Output(prompt_len=len(prompt.input_ids), start=time.perf_counter())
        try:
            it = await engine.async_generate(
                input_ids=prompt.input_ids, sampling_params=sampling_params(prompt), stream=True
            )
            async for event in it:
                out.observe(event)
            out.close()
        except Exception as e:
            out.error = f"{type(e).__name__}: {e}"
        return out

    return send


# --- load generation --------------------------------------------------------------------------
async def run_load(
    send: Callable[[Prompt], Awaitable[Output]],
    prompts: list[Prompt],
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    progress: bool = True,
) -> tuple[list[Output], float]:
    """Send every prompt (Poisson arrivals at `request_rate` per second, inf = all at once), at most
    `max_concurrency` in flight. Returns the outputs in prompt order and the wall time."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    done = 0

    async def one(p: Prompt) -> Output:
        nonlocal done
        if sem is None:
            out = await send(p)
        else:
            async with sem:
                out = await send(p)
        done += 1
        if progress and sys.stderr.isatty():
            print(f"\r  {done}/{len(prompts)} requests", end="", file=sys.stderr, flush=True)
        return out

    start = time.perf_counter()
    tasks = []
    for i, p in enumerate(prompts):
        tasks.append(asyncio.create_task(one(p)))
        if math.isfinite(request_rate) and i + 1 < len(prompts):
            await asyncio.sleep(rng.expovariate(request_rate))
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    return list(outputs), duration


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    import numpy as np

    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "median": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def summarize(outputs: list[Output], duration: float) -> dict[str, Any]:
    """Aggregate metrics (latencies in ms) over the successful requests."""
    ok = [o for o in outputs if o.success]
    inp = sum(o.prompt_len for o in ok)
    outp = sum(o.output_len for o in ok)
    tpot = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    errors = sorted({o.error for o in outputs if not o.success})
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": inp,
        "total_output_tokens": outp,
        "request_throughput": len(ok) / duration,
        "input_throughput": inp / duration,
        "output_throughput": outp / duration,
        "total_throughput": (inp + outp) / duration,
        "ttft_ms": _stats([o.ttft for o in ok]),
        "itl_ms": _stats([x for o in ok for x in o.itl]),
        "tpot_ms": _stats(tpot),
        "e2e_latency_ms": _stats([o.latency for o in ok]),
        "errors": errors[:5],
    }


# --- server handling ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """ServerArgs fields given on the command line."""
    kw = {k: getattr(args, k) for k in ENGINE_OPTIONS if getattr(args, k) is not None and getattr(args, k) is not False}
    kw["model"] = args.model
    return kw


def serve_command(kw: dict[str, Any], port: int) -> list[str]:
    cmd = [sys.executable, "-m", "plait.cli", "serve", "--port", str(port), "--log-level", "warning"]
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        cmd += [flag] if v is True else [flag, str(v)]
    return cmd


@contextlib.contextmanager
def launch_server(kw: dict[str, Any], port: int, timeout: float) -> Any:
    """`plait serve` in a subprocess; yields its base URL once /health answers; SIGTERM at the end."""
    import tempfile

    import httpx

    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            serve_command(kw, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"plait serve exited with {proc.returncode}:\n{log.read()[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"plait serve did not become healthy in {timeout:.0f} s")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                time.sleep(0.25)
            yield base
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


async def bench_http(
    base_url: str, prompts: list[Prompt], args: argparse.Namespace, headers: dict[str, str]
) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=httpx.Timeout(None, connect=30), limits=limits, headers=headers
    ) as client:
        for p in prompts[: args.warmup_requests]:  # warm-up: short, then the cache is emptied
            await send_http(client, Prompt(p.input_ids, min(p.output_len, 4)))
        if not args.no_flush_cache:
            r = await client.post("/flush_cache")
            if r.status_code != 200:
                print(f"warning: /flush_cache answered {r.status_code}", file=sys.stderr)
        outputs, duration = await run_load(
            lambda p: send_http(client, p), prompts, args.request_rate, args.max_concurrency, args.seed
        )
    return summarize(outputs, duration)


def bench_engine(kw: dict[str, Any], prompts: list[Prompt], args: argparse.Namespace) -> dict[str, Any]:
    import plait

    async def go(engine) -> dict[str, Any]:
        send = engine_sender(engine)
        for p in prompts[: args.warmup_requests]:
            await send(Prompt(p.input_ids, min(p.output_len, 4)))
        if not args.no_flush_cache:
            engine.flush_cache()
        outputs, duration = await run_load(send, prompts, args.request_rate, args.max_concurrency, args.seed)
        return summarize(outputs, duration)

    model = kw.pop("model")
    with plait.Engine(model=model, **kw) as engine:
        return asyncio.run(go(engine))


def _server_engine_args(base_url: str, headers: dict[str, str]) -> dict[str, Any]:
    """The engine arguments a running server reports (to give the in-process engine the same)."""
    import httpx

    from plait.runtime.server_args import ServerArgs

    info = httpx.get(base_url + "/get_server_info", headers=headers, timeout=30).json()
    sa = info.get("server_args") or {}
    fields = set(ServerArgs.__dataclass_fields__) - {"log_level"}
    return {k: v for k, v in sa.items() if k in fields and v is not None}


# --- report -------------------------------------------------------------------------------------
def print_table(title: str, m: dict[str, Any]) -> None:
    """SGLang bench_serving-style result table."""
    w = 56
    rows: list[tuple[str, Any]] = [
        ("Successful requests:", m["completed"]),
        ("Failed requests:", m["failed"]),
        ("Benchmark duration (s):", f"{m['duration_s']:.2f}"),
        ("Total input tokens:", m["total_input_tokens"]),
        ("Total generated tokens:", m["total_output_tokens"]),
        ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
        ("Input token throughput (tok/s):", f"{m['input_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{m['total_throughput']:.2f}"),
    ]
    print(f"\n{(' ' + title + ' ').center(w, '=')}")
    for name, value in rows:
        print(f"{name:<{w - 14}}{value!s:>14}")
    for section, key, short in (
        ("End-to-End Latency", "e2e_latency_ms", "E2E Latency"),
        ("Time to First Token", "ttft_ms", "TTFT"),
        ("Inter-Token Latency", "itl_ms", "ITL"),
        ("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT"),
    ):
        print(f" {section} ".center(w, "-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            print(f"{label + ' ' + short + ' (ms):':<{w - 14}}{m[key][stat]:>14.2f}")
    if m["errors"]:
        print("errors: " + "; ".join(m["errors"]))
    print("=" * w)


def print_comparison(server: dict[str, Any], engine: dict[str, Any]) -> dict[str, float]:
    """Server vs in-process engine; overhead = how much lower the server's output throughput is."""
    overhead = 100 * (1 - server["output_throughput"] / engine["output_throughput"])
    print(f"\n{'':34}{'server':>10}{'engine':>10}")
    for label, key, sub in (
        ("output throughput (tok/s)", "output_throughput", None),
        ("request throughput (req/s)", "request_throughput", None),
        ("mean TTFT (ms)", "ttft_ms", "mean"),
        ("mean ITL (ms)", "itl_ms", "mean"),
        ("mean E2E latency (ms)", "e2e_latency_ms", "mean"),
    ):
        s, e = (server[key], engine[key]) if sub is None else (server[key][sub], engine[key][sub])
        print(f"{label:34}{s:10.2f}{e:10.2f}")
    print(f"HTTP server overhead on output throughput: {overhead:.1f}%")
    return {"throughput_overhead_pct": overhead}


# --- main ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="plait bench serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:30000")
    where.add_argument(
        "--launch",
        action="store_true",
        help="start `plait serve` for the run (the default when --base-url is not given)",
    )
    ap.add_argument("--api-key", default=None)
    ap.add_argument(
        "--model",
        default=None,
        help="model to launch (default smollm2); with --base-url the server's model, used for the tokenizer",
    )
    ap.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--chunked-prefill-size", type=int, default=None)
    ap.add_argument("--max-running-requests", type=int, default=None)
    ap.add_argument("--schedule-policy", default=None, choices=["lpm", "fcfs"])
    ap.add_argument("--disable-radix-cache", action="store_true")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--random-seed", type=int, default=None, help="engine seed")
    ap.add_argument("--launch-timeout", type=float, default=300.0, help="seconds to wait for /health")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument(
        "--random-range-ratio", type=float, default=1.0, help="lengths are uniform in [len * ratio, len]; 1.0 = exact"
    )
    ap.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals; inf (default) sends all at once",
    )
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    ap.add_argument("--warmup-requests", type=int, default=1)
    ap.add_argument("--no-flush-cache", action="store_true", help="keep the prefix cache after warm-up")
    ap.add_argument("--seed", type=int, default=1, help="workload seed (prompts and arrivals)")
    ap.add_argument(
        "--compare-engine",
        action="store_true",
        help="also run the load through plait.Engine in-process and print the overhead",
    )
    ap.add_argument("--json", help="write the results here")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise SystemExit("--num-prompts, --input-len and --output-len must be >= 1")
    if not 0 < args.random_range_ratio <= 1:
        raise SystemExit("--random-range-ratio must be in (0, 1]")
    if args.request_rate <= 0:
        raise SystemExit("--request-rate must be > 0 (inf: all at once)")
    try:
        import httpx
    except ImportError:
        raise SystemExit("plait bench serving needs httpx: pip install httpx (or the project's [test] extra)")
    from plait.runtime.model_executor.model_loader import load_tokenizer, resolve_model

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    launch = args.base_url is None
    if launch:
        args.model = args.model or "smollm2"
        kw = engine_kwargs(args)
    else:
        args.base_url = args.base_url.rstrip("/")
        kw = _server_engine_args(args.base_url, headers)
        args.model = (
            args.model
            or kw.get("model")
            or httpx.get(args.base_url + "/get_model_info", headers=headers, timeout=30).json()["model_path"]
        )
        kw["model"] = args.model
    tokenizer = load_tokenizer(resolve_model(args.model))
    prompts = make_prompts(
        tokenizer, args.num_prompts, args.input_len, args.output_len, args.random_range_ratio, args.seed
    )
    config = {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf") for k, v in vars(args).items()}
    result: dict[str, Any] = {"config": config, "engine_args": dict(kw), "load_avg_before": os.getloadavg()}
    print(
        f"model {args.model}  {args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, "
        f"range ratio {args.random_range_ratio}, request rate {args.request_rate}, "
        f"max concurrency {args.max_concurrency}  (load avg {result['load_avg_before'][0]:.2f})",
        flush=True,
    )

    if launch:
        with launch_server(kw, _free_port(), args.launch_timeout) as base:
            result["server"] = asyncio.run(bench_http(base, prompts, args, headers))
    else:
        result["server"] = asyncio.run(bench_http(args.base_url, prompts, args, headers))
    result["load_avg_after_server"] = os.getloadavg()
    print_table("Serving Benchmark Result (plait server)", result["server"])
    if args.compare_engine:
        result["engine"] = bench_engine(dict(kw), prompts, args)
        result["load_avg_after_engine"] = os.getloadavg()
        print_table("In-process plait.Engine", result["engine"])
        result.update(print_comparison(result["server"], result["engine"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
