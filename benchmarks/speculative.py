"""Batch-1 decode speed with n-gram (prompt-lookup) speculative decoding off and on
(`plait bench speculative`).

The workload is output that copies from its input: repeat a JSON record, extract fields from a
document into JSON, restate a short text. Two engines (speculation off / on) run the same greedy
requests one at a time, alternating, several rounds. Decode speed is (tokens - 1) / (end - first
token), measured from the stream; outputs must be identical (speculation must not change greedy
output). Prints per-workload tok/s, the speed-up, the acceptance rate and the machine load.

    plait bench speculative --rounds 3 --max-new-tokens 160
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

RECORD = {"id": "ord-20931", "customer": {"name": "Maria Lopez", "email": "maria.lopez@northwind.example",
                                          "city": "Seattle"},
          "items": [{"sku": "NB-204", "name": "blue notebook", "qty": 3, "price": 4.5},
                    {"sku": "PN-118", "name": "red gel pen", "qty": 10, "price": 1.25}],
          "status": "shipped"}
DOC = ("Invoice 7781 was issued on 12 March 2024 by Harbor Cloud Ltd, 14 Quay Street, Singapore, to "
       "Baltic Soft SIA, Riga. It covers 40 hours of platform engineering at 95 EUR per hour and a "
       "support subscription of 300 EUR, for a total of 4100 EUR, due within 30 days.")
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, "
        "trimmed the wick and polished the great lens until it shone, then sat by the window with his tea "
        "and watched the beam sweep across the dark water.")

WORKLOADS = {
    "repeat-json": "Repeat the following JSON exactly, with no other text:\n" + json.dumps(RECORD),
    "extract-json": ("Extract the invoice number, date, seller, buyer and total from this document as a JSON "
                     "object, copying the values exactly:\n" + DOC),
    "restate-text": "Repeat this paragraph word for word:\n" + TEXT,
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
    ap = argparse.ArgumentParser(prog="plait bench speculative", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--num-draft-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-roofline", action="store_true", help="do not measure the machine's limits")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    import plait
    common = {"model": args.model, "dtype": args.dtype, "num_threads": args.threads, "max_total_tokens": 8192}
    spec_args = {"speculative_algorithm": "ngram"}
    if args.num_draft_tokens:
        spec_args["speculative_num_draft_tokens"] = args.num_draft_tokens
    load = [os.getloadavg()[0]]
    with plait.Engine(**common) as off, plait.Engine(**common, **spec_args) as on:
        tok = off.tokenizer
        prompts = {name: tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True) for name, text in WORKLOADS.items()}
        for eng in (off, on):                                  # warm-up (and the prefix cache)
            for p in prompts.values():
                eng.generate(p, {"temperature": 0, "max_new_tokens": 4})
        before = on.get_server_info()
        runs: dict[str, dict[str, list]] = {name: {"off": [], "on": []} for name in prompts}
        for r in range(args.rounds):
            for name, p in prompts.items():
                order = [("off", off), ("on", on)] if r % 2 == 0 else [("on", on), ("off", off)]
                for label, eng in order:
                    runs[name][label].append(run_one(eng, p, args.max_new_tokens))
            load.append(os.getloadavg()[0])
        after = on.get_server_info()
    proposed = after["num_spec_proposed_tokens"] - before["num_spec_proposed_tokens"]
    accepted = after["num_spec_accepted_tokens"] - before["num_spec_accepted_tokens"]

    rows, identical = [], True
    for name, by in runs.items():
        same = all(a["ids"] == b["ids"] for a, b in zip(by["off"], by["on"]))
        identical &= same
        off_s = statistics.median(x["decode_tok_s"] for x in by["off"])
        on_s = statistics.median(x["decode_tok_s"] for x in by["on"])
        rows.append({"workload": name, "tokens": len(by["off"][0]["ids"]), "off_tok_s": off_s, "on_tok_s": on_s,
                     "speedup": on_s / off_s, "identical": same,
                     "e2e_off_s": statistics.median(x["e2e_s"] for x in by["off"]),
                     "e2e_on_s": statistics.median(x["e2e_s"] for x in by["on"])})
    result = {"config": vars(args), "load_avg": [min(load), max(load)], "rows": rows,
              "accept_rate": accepted / proposed if proposed else 0.0, "proposed": proposed, "accepted": accepted,
              "identical": identical}
    if not args.skip_roofline:
        from plait.benchmarks.roofline import roofline
        result["roofline_batch1_tok_s"] = roofline(args.model, args.dtype, None, args.threads, quick=True)["batch1_tok_s"]
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
    print(f"\nbatch-1 greedy decode, model {c['model']} {c['dtype']}, {c['rounds']} rounds x {c['max_new_tokens']} "
          f"max new tokens, n-gram speculation off / on (load avg {r['load_avg'][0]:.2f}-{r['load_avg'][1]:.2f})")
    print(f"{'workload':16}{'tokens':>8}{'off tok/s':>11}{'on tok/s':>10}{'speedup':>9}{'e2e off s':>11}"
          f"{'e2e on s':>10}{'identical':>11}")
    for x in r["rows"]:
        print(f"{x['workload']:16}{x['tokens']:8d}{x['off_tok_s']:11.1f}{x['on_tok_s']:10.1f}{x['speedup']:8.2f}x"
              f"{x['e2e_off_s']:11.2f}{x['e2e_on_s']:10.2f}{'yes' if x['identical'] else 'NO':>11}")
    gm = statistics.geometric_mean([x["speedup"] for x in r["rows"]])
    print(f"geometric-mean speedup {gm:.2f}x; acceptance {r['accepted']}/{r['proposed']} draft tokens "
          f"= {r['accept_rate']:.0%}; outputs identical: {'yes' if r['identical'] else 'NO'}")
    if "roofline_batch1_tok_s" in r:
        from plait.benchmarks.roofline import fraction_line
        best = max(x["on_tok_s"] for x in r["rows"])
        print(fraction_line("best speculative decode vs batch-1 bandwidth", best, r["roofline_batch1_tok_s"]))


if __name__ == "__main__":
    main()
