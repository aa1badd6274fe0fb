"""JSONSchemaBench (MaskBench sample, shared/data/jsonschemabench) through plait.grammar backends.

Per backend: how many schemas compile within a per-schema time limit, compile time p50/p99, and for
the compiled ones whether a matcher accepts every valid test instance and rejects every invalid one
(walking the instance's tokens; accepted = every token accepted and the grammar can end there),
plus the per-token cost of fill_mask along the valid walks.

An instance is tried in several serializations and counts as accepted if any walks through:
json.dumps with default separators (", ", ": ") and compact (",", ":"), each with non-ASCII as is
and \\u-escaped, and each with the instance's object keys as given and re-ordered to the schema's
`properties` order (xgrammar / outlines make the model write properties in schema order).

    python -m benchmarks.grammar_jsonschemabench --backend xgrammar --json out.json
    python -m benchmarks.grammar_jsonschemabench --backend outlines --timeout 2 --max-memory-mb 1024
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

from .grammar_corpus import percentile  # noqa: E402  (after OMP_WAIT_POLICY)

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "jsonschemabench")


def _default_data() -> str:
    for cand in (DEFAULT_DATA, "/work/shared/data/jsonschemabench"):
        if os.path.exists(os.path.join(cand, "index.json")):
            return os.path.abspath(cand)
    return DEFAULT_DATA


def _resolve(schema: Any, root: Any, depth: int = 0) -> Any:
    """Follow a local $ref ("#/a/b") a few levels."""
    from plait.grammar.schema_rewrite import resolve_local_ref

    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < 20:
        node = resolve_local_ref(root, schema["$ref"])
        if node is None:
            return schema
        schema, depth = node, depth + 1
    return schema


def reorder(data: Any, schema: Any, root: Any, depth: int = 0) -> Any:
    """Best effort: the instance with object keys in the schema's `properties` order (keys not
    listed keep their order, after the listed ones); follows $ref, items, allOf/anyOf/oneOf."""
    if depth > 50:
        return data
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return data
    subs = [s for k in ("allOf", "anyOf", "oneOf") for s in (schema.get(k) or []) if isinstance(s, dict)]
    if isinstance(data, dict):
        props = dict(schema.get("properties") or {})
        for s in subs:
            for k, v in (
                (_resolve(s, root).get("properties") or {}).items() if isinstance(_resolve(s, root), dict) else []
            ):
                props.setdefault(k, v)
        keys = [k for k in props if k in data] + [k for k in data if k not in props]
        addl = schema.get("additionalProperties")
        return {
            k: reorder(data[k], props.get(k, addl if isinstance(addl, dict) else {}), root, depth + 1) for k in keys
        }
    if isinstance(data, list):
        items = schema.get("items")
        prefix = schema.get("prefixItems")
        out = []
        for i, x in enumerate(data):
            if isinstance(prefix, list) and i < len(prefix):
                out.append(reorder(x, prefix[i], root, depth + 1))
            elif isinstance(items, list):
                out.append(reorder(x, items[i] if i < len(items) else {}, root, depth + 1))
            else:
                out.append(reorder(x, items if isinstance(items, dict) else {}, root, depth + 1))
        return out
    return data


def serializations(data: Any, schema: Any) -> list[tuple[str, str]]:
    variants = [("as-is", data)]
    ordered = reorder(data, schema, schema)
    if json.dumps(ordered) != json.dumps(data):
        variants.append(("schema-order", ordered))
    out = []
    seen = set()
    for order, d in variants:
        for style, seps in (("default", (", ", ": ")), ("compact", (",", ":"))):
            for ascii_ in (False, True):
                text = json.dumps(d, separators=seps, ensure_ascii=ascii_)
                if text not in seen:
                    seen.add(text)
                    out.append((f"{style}/{order}/{'ascii' if ascii_ else 'utf8'}", text))
    return out


def walk(grammar, tokenizer, text: str, fill_times: list[float] | None, bitmask) -> bool:
    m = grammar.matcher()
    for t in tokenizer.encode(text, add_special_tokens=False):
        if fill_times is not None:
            t0 = time.perf_counter()
            m.fill_mask(bitmask, 0)
            fill_times.append(time.perf_counter() - t0)
        if not m.accept(t):
            return False
    return m.can_end()


def run_backend(name: str, args, tokenizer, entries: list[dict]) -> dict:
    from plait.grammar import GrammarCache, GrammarError, GrammarSpec, allocate_token_bitmask, make_backend

    opts: dict[str, Any] = {}
    if args.json_whitespace:
        opts["json_whitespace"] = args.json_whitespace
    if name == "outlines":
        opts.update(max_memory_mb=args.max_memory_mb, compile_timeout_s=args.timeout)
    if name in ("xgrammar", "llguidance", "auto") and args.no_strict:
        opts["strict_mode"] = False
    if name == "xgrammar" and args.any_order:
        opts["any_order"] = True
    t0 = time.perf_counter()
    backend = make_backend(name, tokenizer, args.vocab_size, **opts)
    setup_s = time.perf_counter() - t0
    cache = GrammarCache(backend, max_workers=2, compile_timeout_s=args.timeout)
    bitmask = allocate_token_bitmask(1, args.vocab_size)
    rows = []
    fill_times: list[float] = []
    for i, e in enumerate(entries):
        doc = e["doc"]
        row: dict[str, Any] = {"file": e["file"], "subset": e["subset"]}
        try:
            spec = GrammarSpec.from_json_schema(doc["schema"])
            t1 = time.perf_counter()
            grammar = cache.get(spec, timeout=args.timeout * 3 + 10)
            row["compile_s"] = grammar.compile_time_s or (time.perf_counter() - t1)
            row["status"] = "ok"
        except GrammarError as err:
            msg = str(err)
            row["status"] = "timeout" if "took longer" in msg else ("memory" if "memory limit" in msg else "error")
            row["error"] = msg[:300]
            grammar = None
        except Exception as err:  # noqa: BLE001 — a future timeout / backend crash: count it, go on
            row["status"] = "error"
            row["error"] = f"{type(err).__name__}: {err}"[:300]
            grammar = None
        if grammar is not None:
            vt = [t for t in doc.get("tests", []) if t.get("valid")]
            it = [t for t in doc.get("tests", []) if not t.get("valid")]
            row["valid"], row["invalid"] = len(vt), len(it)
            row["valid_ok"] = row["invalid_ok"] = 0
            row["accepted_as"] = []
            for t in vt:
                how = None
                for style, text in serializations(t["data"], doc["schema"]):
                    ft = fill_times if (style.startswith(("default/as-is", "compact/as-is")) and how is None) else None
                    if walk(grammar, tokenizer, text, ft, bitmask):
                        how = style
                        break
                if how:
                    row["valid_ok"] += 1
                    row["accepted_as"].append(how)
            for t in it:
                if not any(
                    walk(grammar, tokenizer, text, None, bitmask)
                    for _, text in serializations(t["data"], doc["schema"])
                ):
                    row["invalid_ok"] += 1
        rows.append(row)
        if args.verbose:
            print(
                f"  [{i + 1}/{len(entries)}] {e['file']}: {row['status']} "
                f"{row.get('compile_s', 0) * 1000:.1f} ms {row.get('valid_ok', '-')}/{row.get('valid', '-')} "
                f"{row.get('invalid_ok', '-')}/{row.get('invalid', '-')} {row.get('error', '')[:100]}",
                file=sys.stderr,
                flush=True,
            )
    cache.shutdown()
    return summarize(name, rows, fill_times, setup_s, opts)


def summarize(name: str, rows: list[dict], fill_times: list[float], setup_s: float, opts: dict) -> dict:
    ok = [r for r in rows if r["status"] == "ok"]
    ct = [r["compile_s"] for r in ok]
    valid = sum(r.get("valid", 0) for r in ok)
    invalid = sum(r.get("invalid", 0) for r in ok)
    styles: dict[str, int] = {}
    for r in ok:
        for s in r.get("accepted_as", []):
            styles[s] = styles.get(s, 0) + 1
    by_subset: dict[str, dict] = {}
    for r in rows:
        d = by_subset.setdefault(
            r["subset"], {"schemas": 0, "compiled": 0, "valid": 0, "valid_ok": 0, "invalid": 0, "invalid_ok": 0}
        )
        d["schemas"] += 1
        if r["status"] == "ok":
            d["compiled"] += 1
            for k in ("valid", "valid_ok", "invalid", "invalid_ok"):
                d[k] += r.get(k, 0)
    return {
        "backend": name,
        "options": opts,
        "setup_s": setup_s,
        "schemas": len(rows),
        "compiled": len(ok),
        "errors": sum(r["status"] == "error" for r in rows),
        "timeouts": sum(r["status"] == "timeout" for r in rows),
        "memory": sum(r["status"] == "memory" for r in rows),
        "compile_p50_ms": statistics.median(ct) * 1000 if ct else float("nan"),
        "compile_p99_ms": percentile(ct, 99) * 1000,
        "compile_max_ms": max(ct) * 1000 if ct else float("nan"),
        "valid": valid,
        "valid_accepted": sum(r.get("valid_ok", 0) for r in ok),
        "invalid": invalid,
        "invalid_rejected": sum(r.get("invalid_ok", 0) for r in ok),
        "schemas_all_correct": sum(
            1 for r in ok if r.get("valid_ok") == r.get("valid") and r.get("invalid_ok") == r.get("invalid")
        ),
        "fill_mask_tokens": len(fill_times),
        "fill_mask_p50_us": statistics.median(fill_times) * 1e6 if fill_times else float("nan"),
        "fill_mask_p99_us": percentile(fill_times, 99) * 1e6,
        "fill_mask_mean_us": statistics.fmean(fill_times) * 1e6 if fill_times else float("nan"),
        "accepted_as": styles,
        "by_subset": by_subset,
        "rows": rows,
    }


def print_table(results: list[dict]) -> None:
    cols = [
        "backend",
        "compiled",
        "errors",
        "timeouts",
        "memory",
        "compile p50 ms",
        "compile p99 ms",
        "valid accepted",
        "invalid rejected",
        "all-correct schemas",
        "fill_mask p50 us",
        "fill_mask p99 us",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print(
            f"| {r['backend']} | {r['compiled']}/{r['schemas']} | {r['errors']} | {r['timeouts']} | {r['memory']} | "
            f"{r['compile_p50_ms']:.1f} | {r['compile_p99_ms']:.1f} | {r['valid_accepted']}/{r['valid']} | "
            f"{r['invalid_rejected']}/{r['invalid']} | {r['schemas_all_correct']}/{r['compiled']} | "
            f"{r['fill_mask_p50_us']:.1f} | {r['fill_mask_p99_us']:.1f} |"
        )
    for r in results:
        print(f"\n{r['backend']} by subset (compiled / valid accepted / invalid rejected):")
        for sub, d in sorted(r["by_subset"].items()):
            print(
                f"  {sub:16s} {d['compiled']:3d}/{d['schemas']:<3d}  {d['valid_ok']:3d}/{d['valid']:<3d}  "
                f"{d['invalid_ok']:3d}/{d['invalid']:<3d}"
            )
        print(f"  valid instances accepted as: {r['accepted_as']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", action="append", help="auto (default) | xgrammar | llguidance | outlines; repeatable")
    ap.add_argument("--data", default=_default_data())
    ap.add_argument("--tokenizer", default=None, help="tokenizer path (default: the smollm2 model)")
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=10.0, help="per-schema compile limit, seconds")
    ap.add_argument("--max-memory-mb", type=int, default=2048, help="outlines: per-compile memory limit")
    ap.add_argument("--json-whitespace", choices=["default", "compact", "any"], default=None)
    ap.add_argument(
        "--no-strict",
        action="store_true",
        help="xgrammar / llguidance / auto: strict_mode=False (objects allow undeclared keys)",
    )
    ap.add_argument("--any-order", action="store_true", help="xgrammar: any_order=True (keys in any order)")
    ap.add_argument("--subset", action="append", help="only these subsets")
    ap.add_argument("--limit", type=int, default=None, help="first N schemas (after --subset)")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    path = args.tokenizer
    if path is None:
        from plait.runtime.model_executor.model_loader import resolve_model

        path = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    args.vocab_size = args.vocab_size or len(tokenizer)

    with open(os.path.join(args.data, "index.json")) as f:
        index = json.load(f)
    if args.subset:
        index = [e for e in index if e["subset"] in args.subset]
    if args.limit:
        index = index[: args.limit]
    entries = []
    for e in index:
        with open(os.path.join(args.data, e["file"]), "rb") as f:
            entries.append(dict(e, doc=json.loads(f.read())))

    results = []
    for name in args.backend or ["auto"]:
        print(f"# {name}: {len(entries)} schemas, limit {args.timeout:g} s", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        r = run_backend(name, args, tokenizer, entries)
        r["wall_s"] = time.perf_counter() - t0
        results.append(r)
    print_table(results)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
