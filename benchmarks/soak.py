"""Soak test: mixed traffic against a live `plait serve` on loopback for a bounded time, then
proof that nothing leaked and nothing was lost.

    plait bench soak --minutes 5 [--model smollm2] [--concurrency 8] [--url http://127.0.0.1:30000]

Traffic (each worker loops, picking at random): plain /generate (n 1-3), streamed /generate,
streamed chat, JSON-schema chat (response_format), forks (one shared prefix, several
continuations in one batch request, n=2), and client aborts (a stream or a plain request
abandoned part-way). Prompts share long prefixes so the radix cache is exercised.

Every few seconds the resident memory (VmRSS) of the server and its child processes (scheduler,
detokenizer) is sampled. At the end the server must go idle with every KV slot free or cached
(/get_server_info kv_slots_in_use == 0), and every request must have been answered or have
failed with an explicit error: `lost` (no answer, a cut stream, a transport error we did not
cause) must be 0. Prints the RSS curve and the counts; exits 1 if anything leaked or was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

KINDS = ("plain", "stream", "chat_stream", "json", "fork", "abort_stream", "abort_plain")
WEIGHTS = (3, 3, 2, 2, 2, 1, 1)
PREFIXES = [
    "You are a careful assistant. Answer briefly and precisely. Here is the question: ",
    "The following is a transcript of a long meeting about the quarterly budget and hiring plans. ",
    "Write a short story about a lighthouse keeper who finds a message in a bottle. It begins: ",
    "List facts about the solar system, one per line, starting with the planets: ",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@dataclass
class Tally:
    """Outcome counts per kind: sent, answered (complete), error (explicit error answer),
    aborted (we disconnected on purpose), lost (anything else)."""

    counts: dict[str, collections.Counter] = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    lost_examples: list[str] = field(default_factory=list)

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        self.counts[kind][outcome] += 1
        if outcome == "lost" and len(self.lost_examples) < 10:
            self.lost_examples.append(f"{kind}: {detail}")

    def total(self, outcome: str) -> int:
        return sum(c[outcome] for c in self.counts.values())


def _prompt(rng: random.Random) -> str:
    return (
        rng.choice(PREFIXES)
        + f"item {rng.randrange(1000)}: "
        + " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega")) for _ in range(rng.randrange(1, 12)))
    )


def _sse(lines: list[str]) -> list:
    return [ln[6:] if ln[6:] == "[DONE]" else json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]


def _stream_outcome(events: list) -> tuple[str, str]:
    """complete / error for a stream that ended with [DONE]; lost for one that did not."""
    if not events or events[-1] != "[DONE]":
        return "lost", f"stream ended without [DONE] after {len(events)} events"
    last = events[-2] if len(events) > 1 else {}
    if isinstance(last, dict) and "error" in last:
        return "error", last["error"].get("code", "")
    return "answered", ""


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random, tally: Tally, max_tokens: int) -> None:
    tally.add(kind, "sent")
    prompt = _prompt(rng)
    sp = {"max_new_tokens": rng.randrange(4, max_tokens), "temperature": rng.choice((0.0, 0.7, 1.0))}
    try:
        if kind in ("plain", "fork", "abort_plain"):
            body = {"text": prompt, "sampling_params": {**sp, "n": rng.randrange(1, 4)}}
            if kind == "fork":
                body = {
                    "text": [prompt + s for s in (" First,", " Second,", " Third,")],
                    "sampling_params": {**sp, "n": 2},
                }
            timeout = rng.uniform(0.05, 0.5) if kind == "abort_plain" else 300
            try:
                r = await client.post("/generate", json=body, timeout=timeout)
            except httpx.TimeoutException:
                if kind == "abort_plain":
                    tally.add(kind, "aborted")
                    return
                raise
            tally.add(kind, "answered" if r.status_code == 200 else "error")
            return
        if kind == "json":
            body = {
                "messages": [{"role": "user", "content": prompt + " Reply in JSON."}],
                "max_tokens": 60,
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
            }
            r = await client.post("/v1/chat/completions", json=body, timeout=300)
            if r.status_code != 200:
                tally.add(kind, "error")
                return
            choice = r.json()["choices"][0]
            if choice["finish_reason"] == "stop":
                json.loads(choice["message"]["content"])  # a complete answer is valid JSON
            tally.add(kind, "answered")
            return
        if kind == "chat_stream":
            path, body = (
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": prompt}],
                    "stream": True,
                    "max_tokens": sp["max_new_tokens"],
                    "n": rng.randrange(1, 3),
                },
            )
        else:
            path, body = "/generate", {"text": prompt, "sampling_params": sp, "stream": True}
        stop_after = rng.randrange(1, 6) if kind == "abort_stream" else None
        async with client.stream("POST", path, json=body, timeout=300) as r:
            if r.status_code != 200:
                await r.aread()
                tally.add(kind, "error")
                return
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if stop_after is not None and sum(ln.startswith("data: ") for ln in lines) >= stop_after:
                    break  # leaving the block closes the connection: the server must abort
        if stop_after is not None and (not lines or lines[-1] != "data: [DONE]"):
            tally.add(kind, "aborted")
            return
        outcome, detail = _stream_outcome(_sse(lines))
        tally.add(kind, outcome, detail)
    except (httpx.HTTPError, ValueError, KeyError) as e:
        tally.add(kind, "lost", f"{type(e).__name__}: {e}")


async def _worker(base: str, deadline: float, seed: int, tally: Tally, max_tokens: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base) as client:
        while time.monotonic() < deadline:
            await _one(client, rng.choices(KINDS, WEIGHTS)[0], rng, tally, max_tokens)


def _children(pid: int) -> list[int]:
    out = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
    return out


def _rss_mib(pid: int) -> float:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _sample(pid: int, names: dict[int, str]) -> dict[str, float]:
    """RSS (MiB) of the server and of each of its children, by name (`names`: pid -> name; other
    children, e.g. multiprocessing's resource tracker, are `other`)."""
    sample = {"server": _rss_mib(pid)}
    for child in _children(pid):
        name = names.get(child, "other")
        sample[name] = sample.get(name, 0.0) + _rss_mib(child)
    return sample


async def _sampler(
    base: str, pid: int, every: float, out: list[tuple[float, dict[str, float]]], stop: asyncio.Event
) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        info = (await client.get("/get_server_info")).json()
    names = {info[k]: k.removesuffix("_pid") for k in ("scheduler_pid", "detokenizer_pid") if k in info}
    t0 = time.monotonic()
    while True:
        out.append((time.monotonic() - t0, _sample(pid, names)))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
            out.append((time.monotonic() - t0, _sample(pid, names)))
            return


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(args: argparse.Namespace):
    """`plait serve` on a free loopback port; yields (base url, pid)."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "plait.cli",
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--max-total-tokens",
        str(args.max_total_tokens),
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"plait serve exited with code {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("plait serve did not become healthy")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.5)
        yield base, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _settle(base: str, timeout: float = 60) -> dict:
    """Wait until the server is idle; its final /get_server_info."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        while True:
            info = (await client.get("/get_server_info")).json()
            idle = not info.get("num_running") and not info.get("num_waiting") and not info.get("num_http_in_flight")
            if (idle and info.get("kv_slots_in_use") == 0) or time.monotonic() > deadline:
                return info
            await asyncio.sleep(0.2)


async def _run(base: str, pid: int | None, args: argparse.Namespace) -> tuple[Tally, list, dict, float]:
    tally = Tally()
    samples: list[tuple[float, dict[str, float]]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sampler(base, pid, args.sample_s, samples, stop)) if pid else None
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    await asyncio.gather(
        *(_worker(base, deadline, args.seed + i, tally, args.max_tokens) for i in range(args.concurrency))
    )
    elapsed = time.monotonic() - t0
    info = await _settle(base)
    stop.set()
    if sampler:
        await sampler
    return tally, samples, info, elapsed


def _report(tally: Tally, samples: list, info: dict, elapsed: float) -> int:
    print(f"soak: {elapsed:.0f} s of mixed traffic")
    if samples:
        names = sorted({k for _, s in samples for k in s}, key=lambda k: (k != "server", k))
        print("\nresident memory (MiB)")
        print("  t (s) " + "".join(f"{n:>12}" for n in names) + "       total")
        for t, s in samples:
            print(f"{t:7.0f} " + "".join(f"{s.get(n, 0):12.1f}" for n in names) + f"{sum(s.values()):12.1f}")
        totals = [sum(s.values()) for _, s in samples]
        q = max(1, len(totals) // 4)
        early, late = sorted(totals[:q])[q // 2], sorted(totals[-q:])[q // 2]
        half = totals[len(totals) // 2 :]
        print(
            f"  RSS median first quarter {early:.1f} MiB, last quarter {late:.1f} MiB, "
            f"change {late - early:+.1f} MiB ({100 * (late - early) / max(early, 1):+.1f}%); "
            f"second half {half[0]:.1f} -> {half[-1]:.1f} MiB ({half[-1] - half[0]:+.1f})"
        )
    print("\nrequests" + "".join(f"{o:>10}" for o in ("sent", "answered", "error", "aborted", "lost")))
    for kind in KINDS:
        c = tally.counts.get(kind, collections.Counter())
        print(f"{kind:>12}" + "".join(f"{c[o]:10d}" for o in ("sent", "answered", "error", "aborted", "lost")))
    print(f"{'total':>12}" + "".join(f"{tally.total(o):10d}" for o in ("sent", "answered", "error", "aborted", "lost")))
    leaked = info.get("kv_slots_in_use")
    print(
        f"\nKV slots in use after settling: {leaked} (of {info.get('max_total_num_tokens')}; "
        f"cached {info.get('cache_size')}, free {info.get('free_slots')}), retractions: {info.get('num_retractions')}"
    )
    for ex in tally.lost_examples:
        print("  lost:", ex)
    ok = leaked == 0 and tally.total("lost") == 0
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """`plait bench soak`."""
    p = argparse.ArgumentParser(prog="plait bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--url", default=None, help="use this running server (no RSS sampling) instead of starting one")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48, help="upper bound of max_new_tokens per request")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="KV pool of the started server")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.url:
        tally, samples, info, elapsed = asyncio.run(_run(args.url.rstrip("/"), None, args))
    else:
        with _server(args) as (base, pid):
            tally, samples, info, elapsed = asyncio.run(_run(base, pid, args))
    return _report(tally, samples, info, elapsed)


if __name__ == "__main__":
    sys.exit(main())
