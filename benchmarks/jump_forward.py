"""JSON extraction with jump-forward decoding on and off (`plait bench jump_forward`).

Each request asks the model to extract a record from a short document into a JSON schema whose
keys, punctuation and enum prefixes are forced by the grammar: with jump-forward they are appended
(greedy requests: verified in the same pass as the next token) instead of decoded one token per
step. Two engines (jump-forward on / off) run the same greedy requests at each concurrency,
alternating, several rounds; the texts must be identical (jump-forward must not change greedy
output) and the table shows requests/s and the speed-up.

    plait bench jump_forward --concurrency 1 4 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SCHEMA = {
    "type": "object",
    "properties": {
        "full_name": {"type": "string", "maxLength": 40},
        "job_title": {"type": "string", "maxLength": 40},
        "employer_company_name": {"type": "string", "maxLength": 40},
        "city_of_residence": {"type": "string", "maxLength": 30},
        "years_of_professional_experience": {"type": "integer", "minimum": 0, "maximum": 60},
        "current_employment_status": {
            "enum": ["employed_full_time", "employed_part_time", "self_employed", "unemployed", "retired"]
        },
        "primary_programming_language": {"enum": ["python", "javascript", "rust", "go", "java", "none"]},
        "is_open_to_new_opportunities": {"type": "boolean"},
    },
    "required": [
        "full_name",
        "job_title",
        "employer_company_name",
        "city_of_residence",
        "years_of_professional_experience",
        "current_employment_status",
        "primary_programming_language",
        "is_open_to_new_opportunities",
    ],
}

DOCS = [
    "Maria Lopez has worked as a data engineer at Northwind Analytics in Seattle for 7 years. She writes "
    "mostly Python and says she is happy where she is.",
    "After 22 years in banking, Tom Becker retired last spring. He lives in Hamburg and still tinkers with Java.",
    "Aiko Tanaka, a freelance frontend developer based in Osaka, has 4 years of experience with JavaScript "
    "and is looking for a full-time role.",
    "Samuel Okafor is a part-time systems programmer at Lagos Fintech Labs. He has 11 years of experience, "
    "prefers Rust, and is not looking to move.",
    "Chen Wei leads the platform team at Harbor Cloud in Singapore. Twelve years in, Go is his language of "
    "choice; recruiters keep calling and he listens.",
    "Olga Petrova lost her job as a QA analyst at Baltic Soft in Riga in March. She has 6 years of "
    "experience, mostly with Python test tooling, and wants a new position soon.",
    "Diego Alvarez runs his own consultancy from Madrid. A Java developer for 15 years, he is open to "
    "interesting contracts.",
    "Fatima Zahra is a junior web developer at Atlas Digital in Casablanca with 2 years of experience in "
    "JavaScript. She plans to stay for now.",
]


def prompts(tokenizer) -> list[str]:
    out = []
    for doc in DOCS:
        msg = "Extract the person's record from the text as JSON.\n\nText: " + doc
        out.append(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": msg}], tokenize=False, add_generation_prompt=True
            )
        )
    return out


def run_batch(engine, texts: list[str], concurrency: int, max_new_tokens: int) -> tuple[float, list[str], int]:
    """Send `texts` with at most `concurrency` in flight; (seconds, output texts, output tokens)."""
    params = {"json_schema": SCHEMA, "temperature": 0, "max_new_tokens": max_new_tokens}
    outs: list = []
    t0 = time.perf_counter()
    for i in range(0, len(texts), concurrency):
        outs += engine.generate(texts[i : i + concurrency], [params] * len(texts[i : i + concurrency]))
    dt = time.perf_counter() - t0
    return dt, [o["text"] for o in outs], sum(o["meta_info"]["completion_tokens"] for o in outs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--grammar-backend", default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=2, help="alternating on/off rounds per concurrency")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)

    import plait

    common = dict(
        model=args.model,
        dtype=args.dtype,
        grammar_backend=args.grammar_backend,
        disable_radix_cache=True,
        num_threads=args.num_threads,
    )
    engines = {"on": plait.Engine(**common), "off": plait.Engine(**common, disable_jump_forward=True)}
    try:
        texts = prompts(engines["on"].tokenizer)
        for e in engines.values():  # compile the grammar, warm up
            run_batch(e, texts[:1], 1, args.max_new_tokens)
        rows = []
        for c in args.concurrency:
            secs: dict[str, list[float]] = {"on": [], "off": []}
            outs: dict[str, list[str]] = {}
            toks: dict[str, int] = {}
            for _ in range(args.rounds):
                for mode in ("off", "on"):
                    dt, out, n = run_batch(engines[mode], texts, c, args.max_new_tokens)
                    secs[mode].append(dt)
                    outs[mode], toks[mode] = out, n
            valid = sum(_is_record(t) for t in outs["on"])
            on, off = statistics.median(secs["on"]), statistics.median(secs["off"])
            rows.append(
                {
                    "concurrency": c,
                    "requests": len(texts),
                    "off_s": off,
                    "on_s": on,
                    "off_req_s": len(texts) / off,
                    "on_req_s": len(texts) / on,
                    "speedup": off / on,
                    "identical": outs["on"] == outs["off"],
                    "valid_json": valid,
                    "output_tokens": toks["on"],
                }
            )
        print(
            f"JSON extraction, {len(texts)} greedy requests, grammar backend {args.grammar_backend}, "
            f"load {os.getloadavg()[0]:.2f}"
        )
        print("| concurrency | jump off req/s | jump on req/s | speed-up | identical text | valid JSON |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['concurrency']} | {r['off_req_s']:.3f} | {r['on_req_s']:.3f} | {r['speedup']:.2f}x | "
                f"{r['identical']} | {r['valid_json']}/{r['requests']} |"
            )
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(rows, f, indent=1)
        return 0 if all(r["identical"] for r in rows) else 1
    finally:
        for e in engines.values():
            e.shutdown()


def _is_record(text: str) -> bool:
    try:
        return set(json.loads(text)) == set(SCHEMA["required"])
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
