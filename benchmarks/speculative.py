"""Batch-1 decode speed with speculative decoding off and on (`plait bench speculative`):
n-gram (prompt-lookup) drafts and/or a draft model.

The workloads are output that copies from its input (repeat a JSON record, extract fields from a
document into JSON, restate a short text), where n-gram drafts shine, and free text (a short
story), where only a draft model can guess. One engine per mode (off, and each `--algorithm`)
runs the same greedy requests one at a time, the engines' order rotating, several rounds. Decode
speed is (tokens - 1) / (end - first token), measured from the stream; outputs must be identical
(speculation must not change greedy output). Prints per-workload tok/s, the speed-up, each mode's
acceptance rate and the machine load. The default draft model is the target itself, quantized
(`--draft-quantization`): the same tokenizer by construction, and close to the target's choices.

    plait bench speculative --rounds 3 --max-new-tokens 160
    plait bench speculative --algorithm ngram draft --draft-quantization int4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

RECORD = {
    "id": "ord-20931",
    "customer": {"name": "Maria Lopez", "email": "maria.lopez@northwind.example", "city": "Seattle"},
    "items": [
        {"sku": "NB-204", "name": "blue notebook", "qty": 3, "price": 4.5},
        {"sku": "PN-118", "name": "red gel pen", "qty": 10, "price": 1.25},
    ],
    "status": "shipped",
}
DOC = (
    "Invoice 7781 was issued on 12 March 2024 by Harbor Cloud Ltd, 14 Quay Street, Singapore, to "
    "Baltic Soft SIA, Riga. It covers 40 hours of platform engineering at 95 EUR per hour and a "
    "support subscription of 300 EUR, for a total of 4100 EUR, due within 30 days."
)
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, "
    "trimmed the wick and polished the great lens until it shone, then sat by the window with his tea "
    "and watched the beam sweep across the dark water."
)

WORKLOADS = {
    "repeat-json": "Repeat the following JSON exactly, with no other text:\n" + json.dumps(RECORD),
    "extract-json": (
        "Extract the invoice number, date, seller, buyer and total from this document as a JSON "
        "object, copying the values exactly:\n" + DOC
    ),
    "restate-text": "Repeat this paragraph word for word:\n" + TEXT,
    "free-story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def run_one(engine, prompt: str, max_new: int) -> dict:
    """One streamed greedy request: token ids, time to first token, end time."""
    t0 = time.perf_counter()
    first = last = None
    for chunk in engine.generate(prompt, {"temperature": 0, "max_new_tokens": max_new}, stream=True):
        if first is None and chunk["output_ids"]:
            first = time.perf_counter()
        last = chunk
    end = time.perf_counter()
    ids = last["output_ids"]
    decode_s = end - (first or t0)
    return {"ids": ids, "e2e_s": end - t0, "decode_tok_s": (len(ids) - 1) / decode_s if decode_s > 0 else 0.0}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="plait bench speculative", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--algorithm",
        nargs="+",
        default=["ngram"],
        choices=["ngram", "draft"],
        help="speculation modes compared with no speculation",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--num-draft-tokens", type=int, default=None, help="n-gram drafts per step (default: the engine's)")
    ap.add_argument("--draft-model", default=None, help="draft mode: the draft model (default: --model)")
    ap.add_argument(
        "--draft-quantization", default="int8", help="draft mode: the draft model's quantization ('none' for none)"
    )
    ap.add_argument(
        "--draft-num-tokens",
        type=int,
        default=None,
        help="draft mode: most draft tokens per step (default: the engine's)",
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-roofline", action="store_true", help="do not measure the machine's limits")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    import plait

    common = {"model": args.model, "dtype": args.dtype, "num_threads": args.threads, "max_total_tokens": 8192}
    modes = {"off": {}}
    if "ngram" in args.algorithm:
        modes["ngram"] = {"speculative_algorithm": "ngram"}
        if args.num_draft_tokens:
            modes["ngram"]["speculative_num_draft_tokens"] = args.num_draft_tokens
    if "draft" in args.algorithm:
        quant = None if args.draft_quantization == "none" else args.draft_quantization
        modes["draft"] = {
            "speculative_algorithm": "draft",
            "speculative_draft_model": args.draft_model or args.model,
            "speculative_draft_quantization": quant,
        }
        if args.draft_num_tokens:
            modes["draft"]["speculative_num_draft_tokens"] = args.draft_num_tokens
    load = [os.getloadavg()[0]]
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(plait.Engine(**common, **kw)) for name, kw in modes.items()}
        tok = engines["off"].tokenizer
        prompts = {
            name: tok.apply_chat_template(
                [{"role": "user", "content": WORKLOADS[name]}], tokenize=False, add_generation_prompt=True
            )
            for name in args.workloads
        }
        for eng in engines.values():  # warm-up (and the prefix cache)
            for p in prompts.values():
                eng.generate(p, {"temperature": 0, "max_new_tokens": 4})
        before = {name: eng.get_server_info() for name, eng in engines.items()}
        runs: dict[str, dict[str, list]] = {w: {m: [] for m in modes} for w in prompts}
        names = list(modes)
        for r in range(args.rounds):
            for w, p in prompts.items():
                order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no mode always first
                for m in order:
                    runs[w][m].append(run_one(engines[m], p, args.max_new_tokens))
            load.append(os.getloadavg()[0])
        after = {name: eng.get_server_info() for name, eng in engines.items()}

    accept = {}
    for m in names[1:]:
        proposed = after[m]["num_spec_proposed_tokens"] - before[m]["num_spec_proposed_tokens"]
        accepted = after[m]["num_spec_accepted_tokens"] - before[m]["num_spec_accepted_tokens"]
        accept[m] = {"proposed": proposed, "accepted": accepted, "rate": accepted / proposed if proposed else 0.0}
    rows, identical = [], True
    for w, by in runs.items():
        off = by["off"]
        row = {
            "workload": w,
            "tokens": len(off[0]["ids"]),
            "off_tok_s": statistics.median(x["decode_tok_s"] for x in off),
            "e2e_off_s": statistics.median(x["e2e_s"] for x in off),
            "modes": {},
        }
        for m in names[1:]:
            same = all(a["ids"] == b["ids"] for a, b in zip(off, by[m]))
            identical &= same
            tok_s = statistics.median(x["decode_tok_s"] for x in by[m])
            row["modes"][m] = {
                "tok_s": tok_s,
                "speedup": tok_s / row["off_tok_s"],
                "identical": same,
                "e2e_s": statistics.median(x["e2e_s"] for x in by[m]),
            }
        rows.append(row)
    result = {
        "config": vars(args),
        "load_avg": [min(load), max(load)],
        "rows": rows,
        "acceptance": accept,
        "identical": identical,
    }
    if not args.skip_roofline:
        from plait.benchmarks.roofline import roofline

        result["roofline_batch1_tok_s"] = roofline(args.model, args.dtype, None, args.threads, quick=True)[
            "batch1_tok_s"
        ]
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if not identical:
        print("ERROR: outputs differ with speculation on", file=sys.stderr)
        sys.exit(1)
    return result


def print_table(r: dict) -> None:
    c = r["config"]
    modes = list(r["acceptance"])
    draft = (
        f"; draft model {c['draft_model'] or c['model']} {c['draft_quantization']}, up to "
        f"{c['draft_num_tokens'] or 'the default'} drafts/step"
        if "draft" in modes
        else ""
    )
    print(
        f"\nbatch-1 greedy decode, model {c['model']} {c['dtype']}, {c['rounds']} rounds x {c['max_new_tokens']} "
        f"max new tokens{draft} (load avg {r['load_avg'][0]:.2f}-{r['load_avg'][1]:.2f})"
    )
    print(
        f"{'workload':14}{'tokens':>7}{'off tok/s':>10}"
        + "".join(f"{m + ' tok/s':>13}{'speedup':>9}" for m in modes)
        + f"{'identical':>11}"
    )
    for x in r["rows"]:
        same = all(v["identical"] for v in x["modes"].values())
        print(
            f"{x['workload']:14}{x['tokens']:7d}{x['off_tok_s']:10.1f}"
            + "".join(f"{x['modes'][m]['tok_s']:13.1f}{x['modes'][m]['speedup']:8.2f}x" for m in modes)
            + f"{'yes' if same else 'NO':>11}"
        )
    for m in modes:
        gm = statistics.geometric_mean([x["modes"][m]["speedup"] for x in r["rows"]])
        a = r["acceptance"][m]
        print(
            f"{m}: geometric-mean speedup {gm:.2f}x; acceptance {a['accepted']}/{a['proposed']} draft tokens "
            f"= {a['rate']:.0%}"
        )
    print(f"outputs identical: {'yes' if r['identical'] else 'NO'}")
    if "roofline_batch1_tok_s" in r and modes:
        from plait.benchmarks.roofline import fraction_line

        best = max(v["tok_s"] for x in r["rows"] for v in x["modes"].values())
        print(fraction_line("best speculative decode vs batch-1 bandwidth", best, r["roofline_batch1_tok_s"]))


if __name__ == "__main__":
    main()
