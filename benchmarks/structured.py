"""Structured output as a client meets it: JSON schemas through `plait serve`'s OpenAI API.

For each grammar backend (a server each), every schema of the JSONSchemaBench sample
(shared/data/jsonschemabench, 300) and of the hand-written API corpus (tests/schema_corpus.py, 60)
goes out as a chat request with `response_format` json_schema at --temperature / --max-tokens, all
at --concurrency. Each answer is one of:
- rejected: a 400 (the schema does not compile: the message names why);
- withheld: a 500 "invalid output" (the document broke the schema and was not returned);
- valid: finish_reason "stop" and the document parses and validates (jsonschema, formats as the
  corpus checks them);
- invalid: "stop" but the document does not validate (returned as if fine: the failure to avoid);
- truncated: finish_reason "length";
with completion tokens per document. Then throughput, constrained vs free, at concurrency 1 and 32:
the first corpus schemas greedy, then the same prompts unconstrained with `ignore_eos` and exactly
the tokens each constrained answer took (tokens/s over the batch; the ratio is the cost of the
grammar's masks: each schema's grammar is compiled before, by a one-token request),
`--throughput-rounds` such pairs back to back, the median ratio reported.

    plait bench structured --backend auto --json out.json
    plait bench structured --backend auto --backend xgrammar --limit 50 --no-throughput
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .grammar_corpus import _corpus  # noqa: E402  (after OMP_WAIT_POLICY)
from .grammar_jsonschemabench import _default_data  # noqa: E402
from .serving import _free_port, launch_server  # noqa: E402

OUTCOMES = ("valid", "invalid", "withheld", "truncated", "rejected", "error")
SCHEMA_CHARS = 1500  # the prompt shows at most this much of the schema


def load_schemas(data: str, subsets: list[str] | None, limit: int | None) -> list[tuple[str, str, dict, str]]:
    """(source, name, schema, instruction): the sample's schemas, then the corpus'."""
    out = []
    with open(os.path.join(data, "index.json")) as f:
        index = json.load(f)
    for e in index:
        if subsets and e["subset"] not in subsets:
            continue
        with open(os.path.join(data, e["file"])) as f:
            schema = json.load(f)["schema"]
        text = json.dumps(schema, ensure_ascii=False)[:SCHEMA_CHARS]
        out.append(("jsonschemabench", e["file"], schema, f"Write one JSON document for this JSON schema:\n{text}"))
    corpus = _corpus()
    if not subsets or "corpus" in subsets:
        out += [("corpus", name, schema, corpus.describe(name)) for name, schema in corpus.SCHEMAS]
    return out[:limit] if limit else out


def classify(schema: dict, status: int, body: dict) -> tuple[str, int, str]:
    """(outcome, completion tokens, detail) of one answer."""
    if status == 400:
        return "rejected", 0, body.get("error", {}).get("message", "")[:200]
    if status >= 500 and "invalid output" in json.dumps(body):
        return "withheld", 0, body.get("error", {}).get("message", "")[:200]
    if status != 200:
        return "error", 0, json.dumps(body)[:200]
    choice = body["choices"][0]
    tokens = body.get("usage", {}).get("completion_tokens", 0)
    if choice["finish_reason"] == "length":
        return "truncated", tokens, ""
    corpus = _corpus()
    try:
        doc = json.loads(choice["message"]["content"])
    except ValueError as e:
        return "invalid", tokens, f"not JSON: {e}"
    try:
        import jsonschema

        validator = jsonschema.validators.validator_for(schema)(schema, format_checker=corpus.format_checker())
        error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    except Exception as e:  # noqa: BLE001 — a schema jsonschema itself cannot use
        return "valid", tokens, f"unchecked: {type(e).__name__}"
    if error is not None:
        return "invalid", tokens, f"{error.validator} at {list(error.absolute_path)}: {error.message[:120]}"
    return "valid", tokens, ""


async def _post(client, body: dict) -> tuple[int, dict]:
    r = await client.post("/v1/chat/completions", json=body)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"error": {"message": r.text[:200]}}


async def run_schemas(base: str, schemas, args) -> list[dict]:
    import httpx

    sem = asyncio.Semaphore(args.concurrency)

    async def one(client, i: int, item) -> dict:
        source, name, schema, ask = item
        body = {
            "messages": [{"role": "user", "content": ask}],
            "temperature": args.temperature,
            "max_tokens": args.max_tokens,
            "seed": args.seed + i,
            "response_format": {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}},
        }
        async with sem:
            status, reply = await _post(client, body)
        outcome, tokens, detail = classify(schema, status, reply)
        return {"source": source, "name": name, "outcome": outcome, "tokens": tokens, "detail": detail}

    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(None, connect=30)) as client:
        return await asyncio.gather(*(one(client, i, item) for i, item in enumerate(schemas)))


async def throughput(base: str, schemas, concurrency: int, n: int, rounds: int = 1) -> dict:
    """Output tokens/s, constrained then free with the same token counts, over n requests; `rounds`
    such pairs back to back, the medians reported (a pair shares the host's load of the moment: on
    a shared 2-core host single runs of either drifted by a quarter)."""
    import httpx

    items = schemas[:n]
    sem = asyncio.Semaphore(concurrency)

    async def batch(client, bodies: list[dict]) -> tuple[float, list[int]]:
        async def one(b):
            async with sem:
                return await _post(client, b)

        t0 = time.perf_counter()
        replies = await asyncio.gather(*(one(b) for b in bodies))
        dt = time.perf_counter() - t0
        return dt, [r[1].get("usage", {}).get("completion_tokens", 0) if r[0] == 200 else 0 for r in replies]

    def body(item, **kw):
        return {"messages": [{"role": "user", "content": item[3]}], "temperature": 0, **kw}

    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(None, connect=30)) as client:
        constrained = [
            body(
                it,
                max_tokens=256,
                response_format={"type": "json_schema", "json_schema": {"name": "doc", "schema": it[2]}},
            )
            for it in items
        ]
        # warm: every schema's grammar compiled (the server caches them by schema, as a service
        # answering the same schemas again has them), the decode path's caches hot
        await batch(client, [{**b, "max_tokens": 1} for b in constrained])
        pairs = []
        for _ in range(max(1, rounds)):
            dt_c, toks = await batch(client, constrained)
            free = [body(it, max_tokens=max(t, 1), ignore_eos=True) for it, t in zip(items, toks)]
            dt_f, toks_f = await batch(client, free)
            pairs.append((sum(toks) / dt_c, sum(toks_f) / dt_f))
    ratios = [c / f for c, f in pairs if f]
    return {
        "concurrency": concurrency,
        "requests": len(items),
        "tokens": sum(toks),
        "constrained_tok_s": round(statistics.median(c for c, _ in pairs), 1),
        "free_tok_s": round(statistics.median(f for _, f in pairs), 1),
        "ratio": round(statistics.median(ratios), 3) if ratios else None,
        "ratios": [round(r, 3) for r in ratios],
    }


def summarize(rows: list[dict]) -> dict:
    out: dict[str, Any] = {}
    for source in ("jsonschemabench", "corpus", "all"):
        sel = [r for r in rows if source == "all" or r["source"] == source]
        if not sel:
            continue
        counts = {k: sum(r["outcome"] == k for r in sel) for k in OUTCOMES}
        accepted = len(sel) - counts["rejected"]
        toks = [r["tokens"] for r in sel if r["outcome"] == "valid"]
        out[source] = {
            "schemas": len(sel),
            **counts,
            "valid_of_accepted": round(counts["valid"] / accepted, 4) if accepted else None,
            "truncated_of_accepted": round(counts["truncated"] / accepted, 4) if accepted else None,
            "tokens_per_valid_doc": round(statistics.mean(toks), 1) if toks else None,
        }
    return out


def print_report(name: str, summary: dict, rows: list[dict], tput: list[dict]) -> None:
    print(f"\n== backend {name}")
    head = f"{'source':16}{'schemas':>8}" + "".join(f"{k:>10}" for k in OUTCOMES) + f"{'valid/acc':>10}{'tok/doc':>9}"
    print(head)
    for source, s in summary.items():
        print(
            f"{source:16}{s['schemas']:>8}"
            + "".join(f"{s[k]:>10}" for k in OUTCOMES)
            + f"{s['valid_of_accepted'] or 0:>10.3f}{s['tokens_per_valid_doc'] or 0:>9}"
        )
    for r in rows:
        if r["outcome"] in ("invalid", "withheld", "error"):
            print(f"  {r['outcome']:9} {r['source']}:{r['name']}: {r['detail']}")
    for t in tput:
        print(
            f"  throughput c={t['concurrency']:<3} {t['requests']} requests, {t['tokens']} tokens: constrained "
            f"{t['constrained_tok_s']} tok/s, free {t['free_tok_s']} tok/s, ratio {t['ratio']} "
            f"(median of {t['ratios']})"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", action="append", help="auto (default) | xgrammar | llguidance | outlines; repeatable")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--data", default=_default_data())
    ap.add_argument("--subset", action="append", help="only these subsets (a sample subset, or 'corpus')")
    ap.add_argument("--limit", type=int, default=None, help="first N schemas")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=768)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--throughput-requests", type=int, default=32, help="at concurrency 32 (a quarter at 1)")
    ap.add_argument("--throughput-rounds", type=int, default=5, help="constrained / free pairs; medians reported")
    ap.add_argument("--launch-timeout", type=float, default=300.0)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)
    schemas = load_schemas(args.data, args.subset, args.limit)
    corpus_items = [s for s in schemas if s[0] == "corpus"] or schemas
    results = []
    for backend in args.backend or ["auto"]:
        kw = {
            "model": args.model,
            "dtype": args.dtype,
            "grammar_backend": backend,
            "max_running_requests": max(args.concurrency, 32),
        }
        with launch_server(kw, _free_port(), args.launch_timeout) as base:
            t0 = time.perf_counter()
            rows = asyncio.run(run_schemas(base, schemas, args))
            elapsed = time.perf_counter() - t0
            tput = (
                []
                if args.no_throughput
                else [
                    asyncio.run(throughput(base, corpus_items, c, min(n, len(corpus_items)), args.throughput_rounds))
                    for c, n in ((1, max(1, args.throughput_requests // 4)), (32, args.throughput_requests))
                ]
            )
        summary = summarize(rows)
        print_report(backend, summary, rows, tput)
        print(f"  ({len(rows)} requests in {elapsed:.0f} s; load {os.getloadavg()[0]:.1f})")
        results.append(
            {"backend": backend, "summary": summary, "throughput": tput, "rows": rows, "seconds": round(elapsed, 1)}
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
