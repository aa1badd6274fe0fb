"""Offline throughput: N chat requests at concurrency C through plait.Engine, side by side with
HF transformers `generate` on the same model, dtype and thread count — one request at a time and
statically batched. Prints a table with ratios; `--json` saves it.

    plait bench offline --num-requests 32 --concurrency 32 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import time

from plait.runtime.server_args import KV_CACHE_DTYPE_CHOICES, set_openmp_defaults

# Both engines get the OpenMP settings of plait's scheduler process (HF runs in this one).
set_openmp_defaults()

TOPICS = [
    "a robot",
    "the sea",
    "a lighthouse",
    "a dragon",
    "the moon",
    "a garden",
    "a train",
    "a city",
    "a violin",
    "a storm",
    "a library",
    "a mountain",
    "a clock",
    "a river",
    "a forest",
    "a desert",
]


def make_prompts(tokenizer, n: int) -> list[str]:
    """Chat prompts of slightly different lengths, rendered with the model's template."""
    out = []
    for i in range(n):
        msg = f"Write a short story about {TOPICS[i % len(TOPICS)]}" + " and its friend" * (i % 4) + f" (story {i})."
        out.append(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": msg}], tokenize=False, add_generation_prompt=True
            )
        )
    return out


def bench_plait(args, prompts: list[str]) -> dict:
    import plait

    with plait.Engine(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        num_threads=args.threads,
        quantization=args.quantization,
        max_running_requests=args.concurrency,
        max_total_tokens=args.max_total_tokens,
    ) as eng:
        params = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
        eng.generate(prompts[0], {"max_new_tokens": 2})  # warm-up
        eng.flush_cache()
        t = time.perf_counter()
        one = eng.generate(prompts[0], params)
        single = len(one["output_ids"]) / (time.perf_counter() - t)
        eng.flush_cache()
        t = time.perf_counter()
        outs = eng.generate(prompts, params)
        dt = time.perf_counter() - t
        tokens = sum(len(o["output_ids"]) for o in outs)
        return {"single_tok_s": single, "batch_tok_s": tokens / dt, "batch_seconds": dt, "tokens": tokens}


def load_hf(model: str, dtype: str, threads: int):
    """(HF model, left-padding tokenizer) for `model` in `dtype` (auto: float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plait.runtime.model_executor.model_loader import resolve_model

    torch.set_num_threads(threads)
    path = resolve_model(model)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype if dtype != "auto" else "float32"]
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval(), tok


def hf_generate(model, tok, prompts: list[str], output_len: int, batch_size: int) -> float:
    """Greedy `generate` of exactly `output_len` tokens per prompt, `batch_size` prompts per call
    (static batching); returns output tok/s."""
    import torch

    gen = {
        "do_sample": False,
        "max_new_tokens": output_len,
        "min_new_tokens": output_len,
        "pad_token_id": tok.pad_token_id,
    }
    with torch.inference_mode():
        t = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            model.generate(**tok(prompts[i : i + batch_size], return_tensors="pt", padding=True), **gen)
        return len(prompts) * output_len / (time.perf_counter() - t)


def bench_hf(args, prompts: list[str]) -> dict:
    model, tok = load_hf(args.model, args.dtype, args.threads)
    hf_generate(model, tok, prompts[:1], 2, 1)  # warm-up
    k = min(args.hf_sequential, len(prompts))
    return {
        "sequential_tok_s": hf_generate(model, tok, prompts[:k], args.output_len, 1),
        "sequential_measured": k,
        "static_tok_s": hf_generate(model, tok, prompts, args.output_len, args.concurrency),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="plait bench offline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPE_CHOICES,
        help="plait's KV cache (HF keeps the model's dtype)",
    )
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument(
        "--hf-sequential", type=int, default=4, help="requests HF runs one at a time (its tok/s is measured on these)"
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--quantization", default=None, choices=["int8", "int4", "gguf"], help="plait's weights (HF stays float)"
    )
    ap.add_argument("--skip-roofline", action="store_true", help="do not measure the machine's limits")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    from plait.runtime.model_executor.model_loader import load_tokenizer, resolve_model

    prompts = make_prompts(load_tokenizer(resolve_model(args.model)), args.num_requests)
    result = {"config": vars(args), "load_avg": os.getloadavg(), "plait": bench_plait(args, prompts)}
    if not args.skip_hf:
        result["hf"] = bench_hf(args, prompts)
    if not args.skip_roofline:
        from plait.benchmarks.roofline import roofline

        r = roofline(args.model, args.dtype, args.quantization, args.threads)
        result["roofline"] = {k: r[k] for k in ("batch1_tok_s", "large_batch_tok_s", "peak_gflops")}
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def print_table(r: dict) -> None:
    c, p = r["config"], r["plait"]
    kv = c["kv_cache_dtype"]
    print(
        f"\nmodel {c['model']}  dtype {c['dtype']}  weights {c.get('quantization') or c['dtype']}  "
        f"KV {c['dtype'] if kv == 'auto' else kv}  threads {c['threads']}  "
        f"{c['num_requests']} requests x {c['output_len']} tokens at concurrency {c['concurrency']}  "
        f"(load avg {r['load_avg'][0]:.2f})"
    )
    print(f"{'':38}{'tok/s':>10}{'plait ratio':>14}")
    print(f"{'plait, concurrent':38}{p['batch_tok_s']:10.1f}")
    print(f"{'plait, single request':38}{p['single_tok_s']:10.1f}")
    if "hf" in r:
        h = r["hf"]
        print(
            f"{'HF generate, one at a time (' + str(h['sequential_measured']) + ' reqs)':38}"
            f"{h['sequential_tok_s']:10.1f}{p['batch_tok_s'] / h['sequential_tok_s']:13.2f}x"
        )
        print(
            f"{'HF generate, static batches':38}{h['static_tok_s']:10.1f}{p['batch_tok_s'] / h['static_tok_s']:13.2f}x"
        )
        print(f"{'single request: plait / HF':38}{'':10}{p['single_tok_s'] / h['sequential_tok_s']:13.2f}x")
    if "roofline" in r:
        from plait.benchmarks.roofline import fraction_line

        print(
            fraction_line("plait single request vs batch-1 bandwidth", p["single_tok_s"], r["roofline"]["batch1_tok_s"])
        )
        print(
            fraction_line(
                "plait concurrent vs large-batch compute", p["batch_tok_s"], r["roofline"]["large_batch_tok_s"]
            )
        )


if __name__ == "__main__":
    main()
