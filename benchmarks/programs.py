"""Program workload in the spirit of the SGLang paper: a mix of few-shot QA after a long shared
prefix (10 worked examples, ~1000 tokens), tree-of-thought with 3 fork branches, JSON extraction
with a schema, and a 3-turn chat — four kinds of plait programs, all starting from the same prefix.

Two runs of the same work, each on its own freshly started in-process Engine:

  (a) plait: the programs through `run_batch` with the radix cache on (the DSL warms the constant
      prefix, forks share their parent's KV, calls of a program reuse what the earlier ones left);
  (b) baseline: the very calls run (a) sent, recorded with their full text and sampling settings,
      replayed one at a time on an Engine started with `disable_radix_cache=True`.

Reports programs/s, their ratio and the cache hit rate (cached prompt tokens / prompt tokens, from
the engine's own counters) of each run.

    plait bench programs --num-programs 16 --max-tokens 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# --- the workload -------------------------------------------------------------------------------------
# (country, capital, river, language, currency, dish, landmark): fictional, so the model cannot
# answer from memory and the examples matter.
FACTS = [
    ("Aldoria", "Vessen", "the Marrow", "Aldorian", "crown", "smoked eel pie", "the Glass Stair"),
    ("Brenmark", "Tollhaven", "the Ister", "Brennish", "mark", "barley stew", "the Old Lighthouse"),
    ("Caldera", "Emberfall", "the Ash", "Calderan", "ember", "spiced lentils", "the Fire Gardens"),
    ("Dunmere", "Lowgate", "the Sedge", "Dunmeric", "penny", "oat cakes", "the Drowned Abbey"),
    ("Estovia", "Karsk", "the Volna", "Estovian", "ruble", "beet dumplings", "the Winter Palace"),
    ("Fennland", "Reedholm", "the Mire", "Fennish", "florin", "pickled herring", "the Stilt Village"),
    ("Galloran", "Highcairn", "the Tarn", "Gallic", "shilling", "mutton pie", "the Standing Stones"),
    ("Hesperia", "Duskport", "the Amber", "Hesperian", "sol", "olive bread", "the Sunset Arch"),
    ("Istria", "Pellan", "the Quill", "Istrian", "lira", "squid risotto", "the Salt Caves"),
    ("Jorvik", "Skaldby", "the Fjell", "Jorvish", "krona", "rye porridge", "the Longhouse Museum"),
    ("Kestrel Isles", "Windward", "the Gannet", "Kestrian", "shell", "coconut fish", "the Cliff Temple"),
    ("Lunaria", "Silverton", "the Pale", "Lunarian", "moon", "honey bread", "the Observatory"),
    ("Morvain", "Blackwater", "the Dun", "Morvish", "groat", "eel soup", "the Peat Towers"),
    ("Norvale", "Frostholm", "the Rime", "Norvalish", "tael", "reindeer roast", "the Ice Hotel"),
]


def _example(f: tuple) -> str:
    country, capital, river, language, currency, dish, landmark = f
    return (
        f"Context: {country} is a small country whose capital is {capital}. Its longest river is {river}, "
        f"most people there speak {language}, and prices are paid in the {currency}. The national dish "
        f"is {dish}, and visitors rarely leave without seeing {landmark}.\n"
        f"Question: What is the capital of {country}, and which river is the longest there?\n"
        f"Answer: The capital is {capital}; the longest river is {river}.\n\n"
    )


def few_shot(n_shots: int) -> str:
    """The shared prefix: instructions and `n_shots` worked examples (10: about 1000 tokens)."""
    return (
        "You answer questions about the countries of an imaginary continent. Read the context of each "
        "example and answer with the facts it states, briefly and exactly, in the same format as the "
        "worked examples below. If the context does not say, answer that it is not known.\n\n"
        + "".join(_example(f) for f in FACTS[:n_shots])
    )


SCHEMA = {
    "type": "object",
    "properties": {
        "capital": {"type": "string", "maxLength": 24},
        "language": {"type": "string", "maxLength": 24},
        "currency": {"type": "string", "maxLength": 24},
    },
    "required": ["capital", "language", "currency"],
    "additionalProperties": False,
}


def define_programs(prefix: str):
    """The four kinds of program after `prefix`, and `workload`, which runs one of them as a
    nested call."""
    import plait as pl

    @pl.function
    def few_shot_qa(s, fact):
        s += prefix + _example(fact).split("Question:")[0]
        s += f"Question: Which dish is {fact[0]} known for?\nAnswer:" + pl.gen("answer", stop="\n")

    @pl.function
    def tree_of_thought(s, fact):
        s += prefix + _example(fact).split("Question:")[0]
        s += f"Question: Would a visitor to {fact[0]} enjoy it?\nConsider three different views first.\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"View {i + 1}:" + pl.gen("view", stop="\n")
        forks.join()
        s += "".join(f"View {i + 1}:{v}\n" for i, v in enumerate(s["view"]))
        s += "Answer:" + pl.gen("answer", stop="\n")

    @pl.function
    def json_extraction(s, fact):
        s += prefix + _example(fact).split("Question:")[0]
        s += f"Extract the capital, language and currency of {fact[0]} as JSON.\nJSON: "
        s += pl.gen("facts", json_schema=SCHEMA)

    @pl.function
    def multi_turn_chat(s, fact):
        s += pl.system(prefix)
        for i, q in enumerate(
            (
                f"Tell me about {fact[0]}. {_example(fact).split('Question:')[0].strip()}",
                "What should I eat there?",
                "And what should I see?",
            )
        ):
            s += pl.user(q)
            s += pl.assistant(pl.gen(f"turn{i}"))

    kinds = {"qa": few_shot_qa, "tot": tree_of_thought, "json": json_extraction, "chat": multi_turn_chat}

    @pl.function
    def workload(s, kind, fact):
        s += kinds[kind](fact)  # nested call: the chosen program runs on this state

    return workload, kinds


def make_batch(n: int, n_shots: int) -> list[dict]:
    """`n` programs, the four kinds in turn, each about a country not among the examples first."""
    kinds = ("qa", "tot", "json", "chat")
    order = FACTS[n_shots:] + FACTS[:n_shots]
    return [{"kind": kinds[i % 4], "fact": order[(i // 4) % len(order)]} for i in range(n)]


# --- the two runs ---------------------------------------------------------------------------------------
def _recording_backend(engine):
    """An EngineBackend that records every request a program sends (not the prefix warm-up)."""
    from plait.frontend import EngineBackend

    class Recording(EngineBackend):
        def __init__(self, eng):
            super().__init__(eng)
            self.calls: list[dict] = []
            self._lock = threading.Lock()

        def _post(self, payload):
            with self._lock:
                self.calls.append(json.loads(json.dumps(payload)))
            return super()._post(payload)

        def _post_stream(self, payload):
            with self._lock:
                self.calls.append(json.loads(json.dumps({**payload, "stream": False})))
            return super()._post_stream(payload)

        def cache_prefix(self, text):
            if text:
                EngineBackend._post(self, self._payload(text, {"max_new_tokens": 0}))

    return Recording(engine)


def _counters(engine) -> tuple[int, int]:
    info = engine.get_server_info()
    return info["num_prompt_tokens"], info["num_cached_tokens"]


def _row(name: str, n: int, calls: int, seconds: float, before: tuple, after: tuple) -> dict:
    prompt, cached = after[0] - before[0], after[1] - before[1]
    return {
        "run": name,
        "programs": n,
        "calls": calls,
        "seconds": seconds,
        "programs_per_s": n / seconds,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
    }


def _engine(args, **extra):
    import plait as pl

    kw = {
        k: v
        for k, v in (("dtype", args.dtype), ("num_threads", args.threads), ("max_total_tokens", args.max_total_tokens))
        if v is not None
    }
    return pl.Engine(model=args.model, random_seed=0, **kw, **extra)


def run_recorded(engine, batch: list[dict], prefix: str, max_tokens: int, num_threads: int) -> tuple[float, list[dict]]:
    """The programs of `batch` (after `prefix`) through `run_batch` on `engine`, every request they
    send recorded; (seconds, calls). Raises when a program failed: the figures would be meaningless."""
    workload, _ = define_programs(prefix)
    be = _recording_backend(engine)
    t = time.perf_counter()
    states = workload.run_batch(batch, backend=be, temperature=0, max_new_tokens=max_tokens, num_threads=num_threads)
    dt = time.perf_counter() - t
    failed = [st.error() for st in states if st.error() is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(states)} programs failed; the first: {failed[0]!r}")
    return dt, be.calls


def run_plait(args, batch: list[dict]) -> tuple[dict, list[dict]]:
    """(a): run_batch on an engine with the radix cache; returns its row and the calls it sent."""
    prefix = few_shot(args.num_shots)
    with _engine(args) as eng:
        eng.generate("Warm-up.", {"max_new_tokens": 2})
        eng.flush_cache()
        before = _counters(eng)
        dt, calls = run_recorded(eng, batch, prefix, args.max_tokens, args.num_threads)
        row = _row("plait programs (run_batch, radix cache)", len(batch), len(calls), dt, before, _counters(eng))
        row["prefix_tokens"] = len(eng.tokenizer(prefix).input_ids)
        return row, calls


def run_sequential(args, calls: list[dict], n_programs: int) -> dict:
    """(b): the same calls one at a time, each a full-text request, on an engine without the cache."""
    from plait.frontend import EngineBackend

    with _engine(args, disable_radix_cache=True) as eng:
        eng.generate("Warm-up.", {"max_new_tokens": 2})
        be = EngineBackend(eng)
        before = _counters(eng)
        t = time.perf_counter()
        for payload in calls:
            be._post(payload)
        dt = time.perf_counter() - t
        return _row("same calls one by one (no radix cache)", n_programs, len(calls), dt, before, _counters(eng))


def print_table(result: dict) -> None:
    c = result["config"]
    print(
        f"\nmodel {c['model']}  programs {c['num_programs']} (qa/tot/json/chat in turn)  "
        f"max_tokens {c['max_tokens']}  shared prefix {result['plait']['prefix_tokens']} tokens "
        f"({c['num_shots']} shots)  "
        f"load {result['load_avg'][0]:.2f}"
    )
    head = (
        f"{'run':42} {'calls':>6} {'seconds':>8} {'programs/s':>11} {'prompt tok':>11} "
        f"{'cached tok':>11} {'hit rate':>9}"
    )
    print(head)
    print("-" * len(head))
    for key in ("plait", "sequential"):
        r = result[key]
        print(
            f"{r['run']:42} {r['calls']:>6} {r['seconds']:>8.2f} {r['programs_per_s']:>11.3f} "
            f"{r['prompt_tokens']:>11} {r['cached_tokens']:>11} {r['hit_rate']:>9.1%}"
        )
    print(f"\nspeedup (programs/s): {result['speedup']:.2f}x  (target >= 3x)")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="plait bench programs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--num-programs", type=int, default=16, help="programs in the batch (kinds in turn)")
    ap.add_argument("--max-tokens", type=int, default=16, help="max new tokens of each gen")
    ap.add_argument("--num-shots", type=int, default=10, help="worked examples in the shared prefix (10: ~1000 tokens)")
    ap.add_argument("--num-threads", type=int, default=64, help="run_batch threads (programs at once)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of each engine")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size of each engine")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.num_programs < 1 or args.max_tokens < 1:
        ap.error("--num-programs and --max-tokens must be >= 1")
    if not 0 <= args.num_shots <= len(FACTS):
        ap.error(f"--num-shots must be between 0 and {len(FACTS)}")

    batch = make_batch(args.num_programs, args.num_shots)
    plait_row, calls = run_plait(args, batch)
    seq_row = run_sequential(args, calls, len(batch))
    result = {
        "config": vars(args),
        "load_avg": os.getloadavg(),
        "plait": plait_row,
        "sequential": seq_row,
        "speedup": plait_row["programs_per_s"] / seq_row["programs_per_s"],
    }
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
