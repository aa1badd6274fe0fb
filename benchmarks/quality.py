"""Quality of reduced-precision weights against float32: greedy agreement and perplexity.

For each configuration (float32 is the reference; bfloat16, int8 and int4 by default) through plait.Engine:
- perplexity on a fixed English text embedded below, and its delta against float32;
- free-running greedy agreement: N chat prompts x L tokens at temperature 0; the mean fraction of
  the L tokens generated before the first token that differs from float32's;
- teacher-forced top-1 agreement: float32's greedy continuations are fed back, and at each
  position the configuration's most likely next token is compared with float32's (token level,
  not thrown off by one early divergence).

    plait bench quality --num-prompts 8 --gen-len 64
    plait bench quality --configs float32 int8 int4   # weights only
    plait bench quality --configs float32 float32/kv-bfloat16   # a bfloat16 KV cache under float32
    PLAIT_INT8_KERNEL=int8pack plait bench quality    # another CPU int8 kernel (runtime/layers/quantization.py)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TEXT = (
    "The history of the lighthouse is a history of trade. For as long as ships have carried goods "
    "along dangerous coasts, people have lit fires on headlands to warn them of rocks and to guide "
    "them into harbour. The most famous of the ancient lights, the Pharos of Alexandria, stood for "
    "more than a thousand years before earthquakes brought it down. Medieval lights were often kept "
    "by monks, and for centuries the fuel was wood, coal or tallow candles, which gave a weak and "
    "smoky light that could be seen only a few miles out to sea.\n\n"
    "Everything changed in the nineteenth century. The Fresnel lens, invented in France in 1822, "
    "gathered the light of a single lamp into a narrow beam that could be seen more than twenty "
    "miles away. Keepers wound clockwork every few hours so that the lens would turn, giving each "
    "lighthouse its own pattern of flashes. Sailors learned to read these patterns the way we read "
    "street signs today. In the twentieth century electricity and automation replaced the keepers, "
    "and satellite navigation has since made many lights unnecessary, yet most of them still shine "
    "every night, because a light that needs no power from the ship can never fail when it is needed."
)

DEFAULT_CONFIGS = ("float32", "bfloat16", "int8", "int4")


def parse_config(name: str) -> dict:
    """`float32` / `bfloat16` -> that dtype; `int8` / `int4` / `fp8` -> float32 model, quantized
    weights; `bfloat16+int4` (and so on) -> that dtype's activations with those weights; any of
    them `/kv-bfloat16` (or `/kv-float32`, `/kv-fp8_e4m3`, `/kv-fp8_e5m2`) -> with that KV cache dtype."""
    base, slash, kv = name.partition("/kv-")
    dtype, plus, weights = base.partition("+")
    if not plus:
        dtype, weights = ("float32", base) if base in ("int8", "int4", "fp8") else (base, None)
    if (
        dtype in ("float32", "bfloat16")
        and weights in (None, "int8", "int4", "fp8")
        and (not slash or kv in ("float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"))
    ):
        out = {"dtype": dtype} if weights is None else {"dtype": dtype, "quantization": weights}
        return {**out, "kv_cache_dtype": kv} if slash else out
    raise ValueError(
        f"unknown configuration {name!r}: float32, bfloat16, int8, int4, fp8 "
        "or DTYPE+WEIGHTS (e.g. bfloat16+int4), optionally /kv-bfloat16, /kv-float32, /kv-fp8_e4m3 "
        "or /kv-fp8_e5m2"
    )


def run_config(
    model: str,
    config: str,
    prompt_ids: list[list[int]],
    text_ids: list[int],
    gen_len: int,
    threads: int | None,
    reference: list[list[int]] | None = None,
) -> dict:
    """Perplexity, greedy outputs and (given float32's outputs) teacher-forced top-1 ids for one config."""
    import plait

    out: dict = {"config": config}
    t = time.perf_counter()
    with plait.Engine(model=model, num_threads=threads, max_total_tokens=16384, **parse_config(config)) as eng:
        res = eng.generate(
            input_ids=text_ids,
            sampling_params={"max_new_tokens": 1, "temperature": 0},
            return_logprob=True,
            logprob_start_len=0,
        )
        lps = [lp for lp, _, _ in res["meta_info"]["input_token_logprobs"][1:]]
        out["perplexity"] = math.exp(-sum(lps) / len(lps))
        eng.flush_cache()
        outs = eng.generate(
            input_ids=prompt_ids,
            sampling_params=[{"temperature": 0, "max_new_tokens": gen_len, "ignore_eos": True}] * len(prompt_ids),
        )
        out["greedy"] = [o["output_ids"] for o in outs]
        if reference is not None:
            eng.flush_cache()
            fed = eng.generate(
                input_ids=[p + r for p, r in zip(prompt_ids, reference)],
                sampling_params=[{"max_new_tokens": 1, "temperature": 0}] * len(prompt_ids),
                return_logprob=True,
                logprob_start_len=1,
                top_logprobs_num=1,
            )
            # The last len(r) input positions predict the reference continuation r.
            out["teacher_forced"] = [
                [row[0][1] for row in f["meta_info"]["input_top_logprobs"][-len(r) :]] for f, r in zip(fed, reference)
            ]
    out["seconds"] = time.perf_counter() - t
    return out


def agreement(got: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """(mean fraction of tokens before the first mismatch, fraction of positions that match)."""
    prefix, same, total = 0.0, 0, 0
    for g, r in zip(got, ref):
        n = next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
        prefix += n / len(r)
        same += sum(a == b for a, b in zip(g, r))
        total += len(r)
    return prefix / len(ref), same / total


def evaluate(
    model: str = "smollm2",
    configs: tuple[str, ...] = DEFAULT_CONFIGS,
    num_prompts: int = 8,
    gen_len: int = 64,
    threads: int | None = None,
) -> dict:
    """Run every configuration against float32; returns per-config metrics."""
    from plait.benchmarks.offline import make_prompts
    from plait.runtime.model_executor.model_loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(model))
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in make_prompts(tok, num_prompts)]
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    ref = run_config(model, "float32", prompt_ids, text_ids, gen_len, threads)
    results = {
        "float32": {
            "perplexity": ref["perplexity"],
            "perplexity_delta": 0.0,
            "greedy_prefix_agreement": 1.0,
            "greedy_token_agreement": 1.0,
            "teacher_forced_agreement": 1.0,
            "seconds": ref["seconds"],
        }
    }
    for config in configs:
        if config == "float32":
            continue
        r = run_config(model, config, prompt_ids, text_ids, gen_len, threads, reference=ref["greedy"])
        prefix, tokens = agreement(r["greedy"], ref["greedy"])
        _, forced = agreement(r["teacher_forced"], ref["greedy"])
        results[config] = {
            "perplexity": r["perplexity"],
            "perplexity_delta": r["perplexity"] - ref["perplexity"],
            "greedy_prefix_agreement": prefix,
            "greedy_token_agreement": tokens,
            "teacher_forced_agreement": forced,
            "seconds": r["seconds"],
        }
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="plait bench quality", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--configs",
        nargs="+",
        default=list(DEFAULT_CONFIGS),
        help="float32 (the reference, always run), bfloat16, int8, int4, fp8, bfloat16+int4, ...",
    )
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    for c in args.configs:
        parse_config(c)
    results = evaluate(args.model, tuple(args.configs), args.num_prompts, args.gen_len, args.threads)
    kernel = os.environ.get("PLAIT_INT8_KERNEL", "default")
    print(
        f"\nmodel {args.model}: {args.num_prompts} prompts x {args.gen_len} greedy tokens, perplexity on "
        f"{len(TEXT)} chars of fixed text; int8 kernel {kernel}  (load avg {os.getloadavg()[0]:.2f})"
    )
    w = max(10, *(len(name) + 2 for name in results))
    print(f"{'config':{w}}{'ppl':>9}{'ppl delta':>11}{'greedy prefix':>15}{'greedy tokens':>15}{'teacher-forced':>16}")
    for name, r in results.items():
        print(
            f"{name:{w}}{r['perplexity']:9.3f}{r['perplexity_delta']:+11.3f}{r['greedy_prefix_agreement']:15.1%}"
            f"{r['greedy_token_agreement']:15.1%}{r['teacher_forced_agreement']:16.1%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "int8_kernel": kernel, "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
